"""aqpipe.data_parallel: replica synchronization (allreduce, decentralized, low-precision
decentralized, QAdam, Qsparse-local-SGD). Not built yet: see the data-parallel issue."""
