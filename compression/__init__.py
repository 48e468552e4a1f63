"""aqpipe.compression: what crosses a slow link, made small.

Usable on its own by any pipeline engine: it imports torch and numpy only.

- `quantize` / `dequantize` / `QuantizedTensor`: k-bit (1..8) min-max quantization with
  unbiased stochastic rounding, packed densely into bytes.
- `ForwardCodec` / `BackwardCodec` / `Message`: boundary codecs (`none`, `direct`, `hadamard`,
  `aqsgd` with per-sample buffers in memory or on disk, in a float dtype or quantized, holding rows only for
  the samples they keep and only once written).
- `entropy`: a lossless Huffman stage over a message's bytes (a transport's, where it takes short messages).
- `topk` / `randk` / `SparseTensor`: sparsifiers for data-parallel compression.
"""
from .buffers import BUFFER_BITS, BufferRangeError, SampleBuffer, row_nbytes
from .sample_ids import SampleIds
from .codecs import BACKWARD_MODES, FIRST_VISIT_MODES, FORWARD_MODES, BackwardCodec, ForwardCodec, Message
from .quantizer import SCALE_DTYPES, QuantizedTensor, check_bits, check_finite, dequantize, quantize
from .sparsify import SparseTensor, randk, topk

__all__ = [
    "BACKWARD_MODES", "BUFFER_BITS", "FIRST_VISIT_MODES", "FORWARD_MODES", "BackwardCodec", "BufferRangeError",
    "ForwardCodec", "Message", "SCALE_DTYPES",
    "QuantizedTensor", "SampleBuffer", "SampleIds", "SparseTensor", "check_bits", "check_finite", "dequantize",
    "quantize", "randk", "row_nbytes", "topk",
]
