"""Train a two-stage model through a compressed boundary: FP32 vs DirectQ vs AQ-SGD.

A miniature of what the pipeline engine does at every stage boundary, in one process:
stage 0 computes an activation, the forward codec carries it (compressed) to stage 1,
stage 1 computes the loss, the backward codec carries the gradient back. Prints, per
mode, the final training loss and the bytes that crossed the boundary.

    python recipes/codec_demo.py [--bits 2] [--epochs 8]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from torch import nn

from aqpipe.compression import BackwardCodec, forward_codec, Message

SEQ, WIDTH, CLASSES, FEATURES = 8, 128, 10, 32


def make_data(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and labels from a fixed random teacher: learnable, not trivially."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, SEQ, FEATURES, generator=g)
    teacher = torch.randn(FEATURES, CLASSES, generator=g)
    y = (torch.tanh(x) @ teacher).mean(dim=1).argmax(dim=-1)
    return x, y


def make_stages(seed: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    stage0 = nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))
    stage1 = nn.Sequential(nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, CLASSES))
    return stage0, stage1


def train(mode: str, args: argparse.Namespace) -> dict:
    x, y = make_data(args.samples, args.seed)
    stage0, stage1 = make_stages(args.seed)
    opt = torch.optim.Adam([*stage0.parameters(), *stage1.parameters()], lr=args.lr)
    bits = None if mode == "none" else args.bits
    backward_mode = "none" if mode == "none" else "direct"
    kw = {"num_samples": args.samples, "sample_shape": (SEQ, WIDTH)} if mode == "aqsgd" else {}
    send, recv = forward_codec(mode, bits, seed=args.seed, **kw), forward_codec(mode, bits, **kw)
    grad_send = BackwardCodec(backward_mode, None if mode == "none" else args.backward_bits, seed=args.seed)
    grad_recv = BackwardCodec(backward_mode, None if mode == "none" else args.backward_bits)
    order_gen = torch.Generator().manual_seed(args.seed)
    fwd_bytes = bwd_bytes = 0
    for epoch in range(args.epochs):
        order = torch.randperm(args.samples, generator=order_gen)
        losses = []
        for start in range(0, args.samples, args.micro_batch_size):
            ids = order[start : start + args.micro_batch_size]
            a = stage0(x[ids])
            msg = send.encode(a.detach(), ids)
            h = recv.decode(Message(msg.payload.clone(), msg.shape, msg.dtype), ids).requires_grad_()
            loss = nn.functional.cross_entropy(stage1(h).mean(dim=1), y[ids])
            opt.zero_grad()
            loss.backward()
            gmsg = grad_send.encode(h.grad)
            a.backward(grad_recv.decode(Message(gmsg.payload.clone(), gmsg.shape, gmsg.dtype)))
            opt.step()
            fwd_bytes += msg.nbytes
            bwd_bytes += gmsg.nbytes
            losses.append(loss.item())
        final = sum(losses) / len(losses)
    return {"mode": mode, "final_epoch_loss": final, "forward_bytes": fwd_bytes, "backward_bytes": bwd_bytes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bits", type=int, default=2, help="forward bits for direct and aqsgd (1-8)")
    p.add_argument("--backward_bits", type=int, default=4, help="bits of the quantized gradient (1-8)")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--micro_batch_size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    for name in ("bits", "backward_bits"):
        if not 1 <= getattr(args, name) <= 8:
            p.error(f"--{name}={getattr(args, name)}: expected 1 to 8")
    for name in ("epochs", "samples", "micro_batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name}={getattr(args, name)}: expected a positive integer")
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

    results = []
    print(f"{'mode':<8} {'final loss':>10} {'fwd MB':>9} {'bwd MB':>9} {'fwd vs fp32':>11} {'s':>5}")
    for mode in ("none", "direct", "aqsgd"):
        t0 = time.perf_counter()
        r = train(mode, args)
        r["seconds"] = time.perf_counter() - t0
        results.append(r)
        ratio = results[0]["forward_bytes"] / r["forward_bytes"]
        label = {"none": "fp32", "direct": f"directq{args.bits}", "aqsgd": f"aqsgd{args.bits}"}[mode]
        print(f"{label:<8} {r['final_epoch_loss']:>10.4f} {r['forward_bytes'] / 1e6:>9.2f} "
              f"{r['backward_bytes'] / 1e6:>9.2f} {ratio:>10.1f}x {r['seconds']:>5.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
