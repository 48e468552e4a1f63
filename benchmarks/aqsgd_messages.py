"""What AQ-SGD's messages cost a GPU stage beside its compute: buffer rows read and written with a host sync per
message (checks read at once, rows copied synchronously) against the pipeline's deferred path (rows through pinned
memory, written and checked once the step's schedule is done), with a cache-free codec and no message at all as
references. Both codec sides run in this one process, so the link costs nothing: what is left is what a message
makes the GPU wait for.

Each micro-batch computes (`--layers` square matmuls of the activation's width), is encoded, decoded, and computes
again; a step is `--micro_batches` of them, an epoch 4 steps of other samples. Every sample has been seen once before
the timing starts, so every timed message sends changes (the steady state after the first epoch); the variants run
interleaved, `--repeats` rounds, and the median step counts.

    python -m benchmarks.aqsgd_messages --device cuda [--shape 4,1024,2048] [--micro_batches 4] [--layers 8]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from aqpipe.compression import ForwardCodec, forward_codec, Message

EPOCH_STEPS = 4  # a step's samples differ from the step before's, as within an epoch
VARIANTS = ("compute alone", "hadamard-4, cache-free", "aqsgd, a host sync a message", "aqsgd, deferred")


def _codecs(variant: str, num_samples: int, sample_shape: tuple[int, ...]) -> tuple[ForwardCodec, ForwardCodec] | None:
    if variant == "compute alone":
        return None
    if variant.startswith("hadamard"):
        pair = forward_codec("hadamard", 4), forward_codec("hadamard", 4)
    else:
        kw = {"num_samples": num_samples, "sample_shape": sample_shape, "first_visit": "direct",
              "first_visit_bits": 4}
        pair = forward_codec("aqsgd", 2, seed=1, **kw), forward_codec("aqsgd", 2, **kw)
    if variant != "aqsgd, a host sync a message":
        for codec in pair:
            codec.defer_checks()  # what every pipeline boundary does
    return pair


def _step(pair, xs: list[torch.Tensor], ids: list[torch.Tensor], w: torch.Tensor, layers: int) -> None:
    for x, mb in zip(xs, ids):
        h = x
        for _ in range(layers):
            h = torch.tanh(h @ w)
        if pair is not None:
            send, recv = pair
            msg = send.encode(h, mb)
            h = recv.decode(Message(msg.payload, msg.shape, msg.dtype), mb)
        for _ in range(layers):
            h = torch.tanh(h @ w)
    if pair is not None:
        for codec in pair:
            codec.take_checks()


def _settle(pair, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for codec in pair or ():
        if codec.buffer is not None:
            codec.end_step()


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="4,1024,2048", help="a micro-batch's activation: batch, tokens, width")
    ap.add_argument("--micro_batches", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8, help="matmuls before and after each message")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    b, t, width = (int(v) for v in args.shape.split(","))
    m = args.micro_batches
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(b, t, width, generator=gen).to(device) for _ in range(m)]
    w = (torch.randn(width, width, generator=gen) / width ** 0.5).to(device)
    epoch = [[torch.arange((s * m + i) * b, (s * m + i + 1) * b) for i in range(m)] for s in range(EPOCH_STEPS)]
    pairs = {v: _codecs(v, EPOCH_STEPS * m * b, (t, width)) for v in VARIANTS}
    for variant, pair in pairs.items():  # every sample seen once, and the kernels compiled
        for ids in epoch:
            _step(pair, xs, ids, w, args.layers)
            _settle(pair, device)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    settles: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for repeat in range(args.repeats):
        for variant, pair in pairs.items():
            _settle(None, device)
            start = time.perf_counter()
            _step(pair, xs, epoch[repeat % EPOCH_STEPS], w, args.layers)
            _settle(None, device)
            done = time.perf_counter()
            _settle(pair, device)
            times[variant].append(time.perf_counter() - start)
            settles[variant].append(time.perf_counter() - done)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, {m} micro-batches of {tuple(xs[0].shape)} float32, {args.layers} + {args.layers} matmuls of "
          f"{width}x{width} around each message, median of {args.repeats} steps")
    base = statistics.median(times["compute alone"])
    rows = []
    for variant in VARIANTS:
        step = statistics.median(times[variant])
        settle = statistics.median(settles[variant])
        rows.append({"variant": variant, "ms_per_step": step * 1e3, "over_compute_ms": (step - base) * 1e3,
                     "settle_ms": settle * 1e3})
        print(f"{variant:32s} {step * 1e3:9.2f} ms a step   +{(step - base) * 1e3:8.2f} ms over compute alone"
              f"   {settle * 1e3:7.2f} ms of it settling after the GPU finished")
    return rows


if __name__ == "__main__":
    main()
