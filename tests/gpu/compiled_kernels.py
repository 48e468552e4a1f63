"""Run by test_cuda_path in a process of its own, where Triton compiles (the suite's runs it interpreted): the
compiled kernels' bytes on CUDA tensors against the C kernels' on the same values, and their unchecked quantize's
finiteness flags. Prints one line per case that
differs, then `checked N`; exits 1 if any differed."""
from __future__ import annotations

import sys

import torch

from aqpipe.compression import dequantize, kernels, quantize


def main() -> int:
    gpu = torch.cuda.is_available()  # without one (a check of this script), Triton's interpreter on CPU tensors
    cases, bad = 0, []
    for shape in ((4, 9, 61), (3, 5, 1600), (2, 7, 2048), (70_001,)):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))) * 3
        for group_size in (None, 8, 13, 64, 1100, 70_001):
            for bits in (1, 2, 3, 4, 8):
                for stochastic in (True, False):
                    out = {}
                    for backend, device in (("native", "cpu"), ("triton", "cuda" if gpu else "cpu")):
                        kernels.configure(backend=backend, interpret=not gpu)
                        q = quantize(x.to(device), bits, generator=torch.Generator().manual_seed(7),
                                     group_size=group_size, stochastic=stochastic)
                        out[backend] = (q.codes.cpu(), q.mins.cpu(), q.steps.cpu(), dequantize(q).cpu())
                    cases += 1
                    if not all(torch.equal(a, b) for a, b in zip(out["native"], out["triton"])):
                        bad.append((shape, group_size, bits, stochastic))
    # the flag a pipeline's codecs leave for their step's one read (quantize(check=False)): false for a group that
    # holds a NaN or an inf or spans more than float32, in every kernel path, as the C kernels'
    flags = 0
    for group_size in (None, 8, 1100):
        for spoil in ("nan", "inf", "wide", None):
            x = torch.randn(3, 5, 1600, generator=torch.Generator().manual_seed(3))
            if spoil == "wide":
                x[1, 2, 100:102] = torch.tensor([-3e38, 3e38])
            elif spoil:
                x[1, 2, 100] = float(spoil)
            for backend, device in (("native", "cpu"), ("triton", "cuda" if gpu else "cpu")):
                kernels.configure(backend=backend, interpret=not gpu)
                finite = bool(quantize(x.to(device), 2, group_size=group_size, check=False).finite())
                flags += 1
                if finite != (spoil is None):
                    bad.append(("flag", backend, group_size, spoil, finite))
    for case in bad:
        print("differs:", case)
    print(f"checked {cases}, flags {flags}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
