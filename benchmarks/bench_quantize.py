"""Quantizer throughput against memory bandwidth, and its error constant c_Q.

GB/s of float32 input for quantize+pack and unpack+dequantize at each bit width,
beside torch.clone of the same tensor (the memory-bandwidth reference), all
timed interleaved in one run so the ratios survive a noisy machine. Also
c_Q = E||x - Q(x)|| / ||x||: AQ-SGD's convergence theorem assumes c_Q < sqrt(1/2).

    python -m benchmarks.bench_quantize [--shape 8,1024,1600] [--repeats 7] [--backends native,torch]
    python -m benchmarks.bench_quantize --device cuda --backends triton,torch --shape 16,1024,1600  # a GPU

On a GPU, clone reads and writes each float32 once (8 bytes an element at the memory's bandwidth): a quantizer as
fast as clone (`quant/clone` >= 1) processes its input at half the memory bandwidth or better, the GPU target.
`kernel/clone`: the backend's quantize kernel alone (`kernels.quantize_flat`, rows as groups, a fixed dither key)
against clone; the gap to `quant/clone` is what `quantize()` adds around it (its finiteness read, the key's draw, the
scales). `deferred/clone`: `quantize(check=False)` and its largest step left on the device, as a pipeline's codecs
call it (their step reads every such value at once, after its schedule). `same as CPU`: the backend's bytes (minima,
steps, codes) and decoded values equal the CPU kernels' for the same generator, on the same tensor. `--host_costs`:
the host's microseconds a call for each piece of that deferred call (where the host, not the GPU, bounds it).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

from aqpipe.compression import dequantize, kernels, quantize
from aqpipe.compression.quantizer import error_constant

TARGET = 0.25  # round trip at >= this fraction of clone speed (2 CPU cores)
CUDA_CALLS = 20  # calls a GPU timing averages
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's kernels on CPU tensors (the tests)


def timed(fn, device: torch.device = torch.device("cpu")) -> float:
    """Seconds a call of `fn` takes, its GPU kernels finished: on a GPU the mean of CUDA_CALLS calls back to back,
    so the synchronization's own latency (tens of microseconds, a third of a 100 MB clone) is not timed."""
    calls = CUDA_CALLS if device.type == "cuda" else 1
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls


c_q = error_constant  # E||x - Q(x)|| / ||x|| over Gaussian rows (the commands in RESULTS.md call it c_q)


def run(shape: tuple[int, ...], bit_widths: list[int], repeats: int, backend: str,
        device: torch.device = torch.device("cpu")) -> list[dict]:
    kernels.configure(backend=backend, interpret=INTERPRET)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device)
    gb = x.numel() * 4 / 1e9
    g = torch.Generator().manual_seed(1)
    samples = {b: {"q": [], "d": [], "k": [], "f": []} for b in bit_widths}
    flat = x.reshape(-1)
    key = (12345, 678)  # a fixed dither key: the kernel alone, without the wrapper's key draw, checks and scales
    clone = []
    for _ in range(repeats + 1):  # the first round warms caches and builds the kernels
        clone.append(timed(lambda: x.clone(), device))
        for b in bit_widths:
            holder = {}
            samples[b]["q"].append(timed(lambda: holder.setdefault("q", quantize(x, b, generator=g)), device))
            samples[b]["d"].append(timed(lambda: dequantize(holder["q"]), device))
            samples[b]["k"].append(timed(lambda: kernels.quantize_flat(flat, shape[-1], b, key), device))
            samples[b]["f"].append(timed(lambda: quantize(x, b, generator=g, check=False).largest_step(), device))
    t_clone = statistics.median(clone[1:])
    rows = []
    kernels.configure(backend="native" if kernels.native_library() is not None else "torch")
    cpu = {b: quantize(x.cpu(), b, generator=torch.Generator().manual_seed(5)) for b in bit_widths}
    kernels.configure(backend=backend, interpret=INTERPRET)
    for b in bit_widths:
        tq, td = statistics.median(samples[b]["q"][1:]), statistics.median(samples[b]["d"][1:])
        tk, tf = statistics.median(samples[b]["k"][1:]), statistics.median(samples[b]["f"][1:])
        q = quantize(x, b, generator=torch.Generator().manual_seed(5))
        same = torch.equal(q.to_bytes().cpu(), cpu[b].to_bytes()) and torch.equal(dequantize(q).cpu(),
                                                                                   dequantize(cpu[b]))
        rows.append({
            "backend": backend, "bits": b, "quantize_GBps": gb / tq, "dequantize_GBps": gb / td,
            "round_trip_GBps": gb / (tq + td), "clone_GBps": gb / t_clone,
            "round_trip_vs_clone": t_clone / (tq + td), "quantize_vs_clone": t_clone / tq,
            "kernel_quantize_vs_clone": t_clone / tk, "deferred_quantize_vs_clone": t_clone / tf,
            "compression": x.numel() * 4 / q.nbytes,
            "c_Q": c_q(b, shape[-1]), "same_bytes_as_cpu": same,
        })
    return rows


def sweep(shape: tuple[int, ...], bits: int, configs: list[tuple[int, int]], repeats: int) -> list[dict]:
    """Triton's one-pass kernel alone at each (elements a program holds, warps) against clone, on CUDA: the
    layout that reads nearest copy speed on this GPU (any layout gives the same bytes: min, max and the packing's
    sums are exact in any order)."""
    from aqpipe.compression import triton_kernels
    kernels.configure(backend="triton")
    x = torch.randn(shape, device="cuda")
    flat, key, device = x.reshape(-1), (12345, 678), x.device
    saved = triton_kernels.FUSED_TILE, triton_kernels.FUSED_WARPS
    rows = []
    for tile, warps in configs:
        triton_kernels.FUSED_TILE, triton_kernels.FUSED_WARPS = tile, warps
        times, clone = [], []
        for _ in range(repeats + 1):
            clone.append(timed(lambda: x.clone(), device))
            times.append(timed(lambda: triton_kernels.quantize_flat(flat, shape[-1], bits, key), device))
        rows.append({"tile": tile, "warps": warps, "bits": bits,
                     "kernel_vs_clone": statistics.median(clone[1:]) / statistics.median(times[1:])})
        print(f"sweep tile {tile:>6} warps {warps:>2} bits {bits}: kernel/clone {rows[-1]['kernel_vs_clone']:.2f}")
    triton_kernels.FUSED_TILE, triton_kernels.FUSED_WARPS = saved
    return rows


def host_costs(shape: tuple[int, ...], bits: int, backend: str, device: torch.device, calls: int = 200) -> dict:
    """Microseconds of host time a call of each piece of a pipeline codec's quantize takes (queued, not waited
    for), beside the whole call's time with its GPU work finished: where the host, not the GPU, bounds a call."""
    from aqpipe.compression.quantizer import _dither_key
    kernels.configure(backend=backend, interpret=INTERPRET)
    x = torch.randn(shape, device=device)
    flat, g, sync = x.reshape(-1), torch.Generator().manual_seed(1), (
        torch.cuda.synchronize if device.type == "cuda" else (lambda: None))
    pieces = {
        "dither key": lambda: _dither_key(g, device),
        "kernel launch": lambda: kernels.quantize_flat(flat, shape[-1], bits, (12345, 678)),
        "finite flag (isfinite, all)": lambda: torch.isfinite(flat[: shape[-1]]).all(),
        "largest step (amax)": lambda: flat[: shape[-1]].amax(),
        "quantize(check=False), largest step": lambda: quantize(x, bits, generator=g, check=False).largest_step(),
        "clone": lambda: x.clone(),
    }
    out = {}
    for name, fn in pieces.items():
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        sync()
        out[name] = {"host_us": (t1 - t0) / calls * 1e6, "finished_us": (time.perf_counter() - t0) / calls * 1e6}
        print(f"host costs, {bits} bits: {name:<38} host {out[name]['host_us']:8.1f} us a call, "
              f"finished {out[name]['finished_us']:8.1f} us")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="8,1024,1600", help="comma-separated tensor shape")
    p.add_argument("--bits", default="1,2,4,8", help="comma-separated bit widths")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--backends", default="native", help="comma-separated: native, triton, torch")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--group_sizes", default="16,32,128", help="group sizes for the c_Q table (beside a whole row)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--sweep", default="", help="CUDA: Triton's one-pass kernel alone at TILExWARPS layouts, "
                   "comma-separated (e.g. 4096x8,8192x8), at each of --bits")
    p.add_argument("--host_costs", action="store_true", help="also time the host side of each piece of a deferred "
                   "quantize (the first backend, the first of --bits)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = tuple(int(s) for s in args.shape.split(","))
    bit_widths = [int(b) for b in args.bits.split(",")]
    print(f"tensor {shape} float32 ({math.prod(shape) * 4 / 1e6:.1f} MB), {torch.get_num_threads()} threads, "
          f"median of {args.repeats}")
    print(f"{'backend':<7} {'bits':>4} {'quant GB/s':>10} {'dequant GB/s':>12} {'round GB/s':>10} "
          f"{'clone GB/s':>10} {'round/clone':>11} {'quant/clone':>11} {'x smaller':>9} {'c_Q':>6} "
          f"{'same as CPU':>11} {'kernel/clone':>12} {'deferred/clone':>14}")
    rows = []
    for backend in args.backends.split(","):
        for r in run(shape, bit_widths, args.repeats, backend, torch.device(args.device)):
            rows.append(r)
            print(f"{r['backend']:<7} {r['bits']:>4} {r['quantize_GBps']:>10.2f} {r['dequantize_GBps']:>12.2f} "
                  f"{r['round_trip_GBps']:>10.2f} {r['clone_GBps']:>10.2f} {r['round_trip_vs_clone']:>11.2f} "
                  f"{r['quantize_vs_clone']:>11.2f} "
                  f"{r['compression']:>9.1f} {r['c_Q']:>6.3f} {'yes' if r['same_bytes_as_cpu'] else 'NO':>11} "
                  f"{r['kernel_quantize_vs_clone']:>12.2f} {r['deferred_quantize_vs_clone']:>14.2f}")
    native = [r for r in rows if r["backend"] == "native"]
    if native:
        worst = min(r["round_trip_vs_clone"] for r in native)
        print(f"target: round trip >= {TARGET} x clone; worst native ratio {worst:.2f} "
              f"({'met' if worst >= TARGET else 'NOT met'})")
    if args.sweep:
        configs = [tuple(int(v) for v in c.split("x")) for c in args.sweep.split(",")]
        for b in bit_widths:
            rows += sweep(shape, b, configs, args.repeats)
    if args.host_costs:
        host_costs(shape, bit_widths[0], args.backends.split(",")[0], torch.device(args.device))
    group_sizes = [int(g) for g in args.group_sizes.split(",")]
    print(f"\nc_Q by group size (AQ-SGD's theorem needs c_Q < {math.sqrt(0.5):.3f}); "
          f"scales cost 64/group_size bits per element")
    print(f"{'bits':>4} " + " ".join(f"{'g=' + str(g):>7}" for g in group_sizes) + f" {'row=' + str(shape[-1]):>9}")
    for b in bit_widths:
        cells = [c_q(b, shape[-1], g) for g in group_sizes] + [c_q(b, shape[-1])]
        print(f"{b:>4} " + " ".join(f"{c:>7.3f}" for c in cells[:-1]) + f" {cells[-1]:>9.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
