"""What a boundary codec costs a stage per micro-batch: encode on the sender, decode on the receiver.

A pipeline stage pays these on its critical path (the sender before its send, the receiver before its
forward), so on a fast link they are what separates a compressed run from FP32. The activation is a
micro-batch of the slow-link benchmark's shape by default (4 x 128 tokens x 128 wide); AQ-SGD is timed
in its steady state (every sample seen, each sent as a change), over a rotating set of samples as a
run visits them. Modes are timed interleaved, and the median over the repeats is printed.

    python -m benchmarks.bench_codecs [--shape 4,128,128] [--repeats 200]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from aqpipe.compression import BackwardCodec, ForwardCodec, forward_codec, Message

SETTINGS = {  # name: (forward codec kwargs, backward codec kwargs)
    "fp32": ({"mode": "none"}, {"mode": "none"}),
    "directq_2_4": ({"mode": "direct", "bits": 2}, {"mode": "direct", "bits": 4}),
    "aqsgd_2_4": ({"mode": "aqsgd", "bits": 2}, {"mode": "direct", "bits": 4}),
}
MICRO_BATCHES = 16  # distinct micro-batches of samples the AQ-SGD buffers hold


def _pair(kwargs: dict, shape: tuple[int, ...]) -> tuple[ForwardCodec, ForwardCodec]:
    if kwargs["mode"] == "aqsgd":
        kwargs = {**kwargs, "num_samples": shape[0] * MICRO_BATCHES, "sample_shape": shape[1:]}
    return forward_codec(seed=1, **kwargs), forward_codec(seed=1, **kwargs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="4,128,128", help="one micro-batch's activation: batch,tokens,width")
    p.add_argument("--repeats", type=int, default=200, help="micro-batches timed per mode")
    args = p.parse_args(argv)
    shape = tuple(int(d) for d in args.shape.split(","))
    if len(shape) != 3 or min(shape) < 1 or args.repeats < 1:
        p.error(f"--shape {args.shape} --repeats {args.repeats}: expected three positive sizes and repeats >= 1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core per stage, as the slow-link benchmark runs
    try:
        _run(shape, args.repeats)
    finally:
        torch.set_num_threads(threads)
    return 0


def _run(shape: tuple[int, ...], repeats: int) -> None:
    """Fill AQ-SGD's buffers, time every setting's four calls interleaved, print the medians."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    ids = [torch.arange(k * shape[0], (k + 1) * shape[0]) for k in range(MICRO_BATCHES)]
    codecs = {}
    for name, (fwd, bwd) in SETTINGS.items():
        sender, receiver = _pair(fwd, shape)
        for k in ids:  # first visits: AQ-SGD's buffers fill, later calls send changes
            msg = sender.encode(x, k)
            receiver.decode(Message(msg.payload, msg.shape, msg.dtype), k)
        codecs[name] = (sender, receiver, BackwardCodec(seed=2, **bwd), BackwardCodec(seed=2, **bwd))
    times: dict[str, list[list[float]]] = {name: [[], [], [], []] for name in SETTINGS}
    for r in range(repeats):
        k = ids[r % MICRO_BATCHES]
        a = x + 0.01 * (r + 1)  # the activation moves a little between visits
        for name, (sender, receiver, grad_sender, grad_receiver) in codecs.items():
            t0 = time.perf_counter()
            msg = sender.encode(a, k)
            t1 = time.perf_counter()
            receiver.decode(Message(msg.payload, msg.shape, msg.dtype), k)
            t2 = time.perf_counter()
            g = grad_sender.encode(a)
            t3 = time.perf_counter()
            grad_receiver.decode(Message(g.payload, g.shape, g.dtype))
            t4 = time.perf_counter()
            for column, seconds in zip(times[name], (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                column.append(seconds)
    print(f"ms per micro-batch of {shape}, median of {repeats}, one thread")
    print(f"{'setting':>12} {'fwd encode':>10} {'fwd decode':>10} {'bwd encode':>10} {'bwd decode':>10}")
    for name, columns in times.items():
        print(f"{name:>12} " + " ".join(f"{1000 * statistics.median(c):10.4f}" for c in columns))


if __name__ == "__main__":
    raise SystemExit(main())
