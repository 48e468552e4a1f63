"""Run by test_cuda_path in a process of its own, where Triton compiles (the suite's runs it interpreted): the
compiled kernels' bytes on CUDA tensors against the C kernels' on the same values. Prints one line per case that
differs, then `checked N`; exits 1 if any differed."""
from __future__ import annotations

import sys

import torch

from compression import dequantize, kernels, quantize


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
    for case in bad:
        print("differs:", case)
    print(f"checked {cases}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
