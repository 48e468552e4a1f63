"""aqpipe's trainer: configuration, data, checkpoints, failure handling and the training loop.

The three libraries it drives sit beside it: `pipeline` (stages, schedules, the engine),
`compression` (the boundary codecs) and `data_parallel` (replica sync). The launchable
scripts in the checkout's `recipes/` are thin wrappers around this package.
"""
