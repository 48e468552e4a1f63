"""What the entropy stage (aqpipe/compression/entropy.py) takes off a message and what it costs: per setting, a
message's bytes packed and coded, the ratio, the coder's time each side (ns a byte of the packed message, the least of
`--repeats` runs), and the link rate below which the bytes saved take longer to send than both sides spend coding
(the stage runs on the host, beside the compute, so above that rate it slows a step that waits on the link).

Messages: seeded Gaussian rows (a Hadamard-rotated activation's rows are close to Gaussian) of the WAN workload's
width, quantized as the boundary codecs do, and float32/bf16 rows sent as is (which the stage leaves raw).

    python -m benchmarks.entropy_coding [--width 256] [--tokens 2048] [--settings 2:64,3:row,4:row,8:row]
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.code_entropy import gaussian_message
from aqpipe.compression import entropy


def _message(setting: str, width: int, tokens: int) -> torch.Tensor:
    if setting in ("float32", "bfloat16"):
        x = torch.randn(tokens, width, generator=torch.Generator().manual_seed(0))
        return x.to(getattr(torch, setting)).reshape(-1).view(torch.uint8)
    bits, group = setting.split(":")
    return gaussian_message(int(bits), None if group == "row" else int(group), width, tokens).to_bytes()


def _least(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def measure(setting: str, width: int, tokens: int, repeats: int) -> dict[str, float]:
    packed = _message(setting, width, tokens)
    n = packed.numel()
    enc_s, coded = _least(lambda: entropy.encode(packed), repeats)
    landing = torch.zeros(entropy.capacity(n), dtype=torch.uint8)
    landing[: coded.numel()] = coded
    dec_s, decoded = _least(lambda: entropy.decode(landing, n), repeats)
    if not torch.equal(decoded, packed):
        raise RuntimeError(f"{setting}: the coded message did not decode to the packed one")
    saved = n - coded.numel()
    # below this rate sending the saved bytes takes longer than coding them on both sides
    even_mbit = saved * 8 / (enc_s + dec_s) / 1e6 if saved > 0 else 0.0
    return {"setting": setting, "packed": n, "coded": coded.numel(), "ratio": coded.numel() / n,
            "encode_ns": enc_s / n * 1e9, "decode_ns": dec_s / n * 1e9, "even_mbit": even_mbit,
            "layout": int(coded[0])}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=256, help="a row's width (the WAN workload's hidden size)")
    ap.add_argument("--tokens", type=int, default=2048, help="rows in a message (a WAN step's 16 x 128 tokens)")
    ap.add_argument("--settings", default="2:64,3:row,4:row,8:row,bfloat16,float32",
                    help="bits:group (row: a whole row), or float32 / bfloat16 rows sent as is")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    names = {entropy.RAW: "raw", entropy.WHOLE: "thirds", entropy.INTERLEAVED: "mod 3"}
    print(f"rows of {args.width}, {args.tokens} rows a message; times: the least of {args.repeats}")
    print("| message | packed bytes | coded bytes | ratio | layout | encode ns/B | decode ns/B | pays below Mbit/s |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for setting in args.settings.split(","):
        r = measure(setting, args.width, args.tokens, args.repeats)
        print(f"| {setting} | {r['packed']} | {r['coded']} | {r['ratio']:.3f} | {names[r['layout']]} | "
              f"{r['encode_ns']:.1f} | {r['decode_ns']:.1f} | {r['even_mbit']:.0f} |")
        rows.append(r)
    return rows


if __name__ == "__main__":
    main()
