"""aqpipe.compression: what crosses a slow link, made small.

Usable on its own by any pipeline engine: it imports torch and numpy only.

- `quantize` / `dequantize` / `QuantizedTensor`: k-bit (1..8) min-max quantization with
  unbiased stochastic rounding, packed densely into bytes.
- `ForwardCodec` / `BackwardCodec` / `Message`: dense boundary codecs (`none`, `direct`, `hadamard`);
  `AQSGDCodec` (built by `aqsgd_codec`; `forward_codec` builds either kind): AQ-SGD, with per-sample buffers in
  memory or on disk, in a float dtype or quantized, holding rows only for the samples they keep, once written;
  `subspace_codecs`: a boundary's activations and gradients as k coefficients a token in a basis both sides hold;
  `SubspaceRowsCodec`: AQ-SGD's changes as k coefficients a row (a tied embedding's rows).
- `entropy`: a lossless Huffman stage over a message's bytes (a transport's, where it takes short messages).
- `topk` / `randk` / `SparseTensor`: sparsifiers for data-parallel compression.
"""
from .buffers import BUFFER_BITS, BufferRangeError, SampleBuffer, row_nbytes
from .sample_ids import SampleIds
from .codecs import (BACKWARD_MODES, DENSE_MODES, FIRST_VISIT_MODES, FORWARD_MODES, BackwardCodec, DenseCodec,
                     ForwardCodec, Message, plain_codecs)
from .aqsgd import AQSGDCodec, aqsgd_codec, forward_codec
from .seeds import derive_seed
from .protocol import Codec
from .subspace import BACKWARD_BASES, Subspace, SubspaceCodec, SubspaceGradCodec, subspace_codecs
from .subspace_rows import SubspaceRowsCodec
from .quantizer import SCALE_DTYPES, QuantizedTensor, check_bits, check_finite, dequantize, quantize
from .sparsify import SparseTensor, randk, topk

__all__ = [
    "Codec", "plain_codecs",
    "AQSGDCodec", "BACKWARD_BASES", "BACKWARD_MODES", "BUFFER_BITS", "DENSE_MODES", "FIRST_VISIT_MODES",
    "FORWARD_MODES",
    "BackwardCodec", "BufferRangeError", "DenseCodec", "ForwardCodec", "Message", "SCALE_DTYPES",
    "QuantizedTensor", "SampleBuffer", "SampleIds", "SparseTensor", "Subspace", "SubspaceCodec", "SubspaceGradCodec",
    "SubspaceRowsCodec",
    "aqsgd_codec", "check_bits", "check_finite",
    "derive_seed", "dequantize", "forward_codec", "quantize", "randk", "row_nbytes", "subspace_codecs", "topk",
]
