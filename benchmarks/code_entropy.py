"""Where a quantized message's bytes are, and what cheaper scales or an entropy coder could take off: per setting,
a message's code and scale bytes, the same with bfloat16 scales (2 + 2 bytes a group instead of 4 + 4), and with
its codes at their order-0 entropy (the bits an ideal coder of independent codes would need, measured on the codes
of seeded Gaussian rows: a Hadamard-rotated activation's rows are close to Gaussian). Arithmetic and one quantize
per setting: nothing here is a codec yet, it prices the next one.

    python -m benchmarks.code_entropy [--width 256] [--tokens 2048] [--settings 2:64,3:row,4:row,8:row]
"""
from __future__ import annotations

import argparse

import torch

from aqpipe.compression import QuantizedTensor, quantize
from aqpipe.compression.kernels import unpack_codes


def gaussian_message(bits: int, group_size: int | None, width: int, tokens: int) -> QuantizedTensor:
    """Seeded Gaussian rows quantized as a boundary codec does: the message both benchmarks of the coder price."""
    x = torch.randn(tokens, width, generator=torch.Generator().manual_seed(0))
    return quantize(x, bits, group_size=group_size, generator=torch.Generator().manual_seed(1))


def price(bits: int, group_size: int | None, width: int, tokens: int) -> dict[str, float]:
    q = gaussian_message(bits, group_size, width, tokens)
    codes = unpack_codes(q.codes, bits, q.numel).long()
    p = torch.bincount(codes, minlength=1 << bits).double() / codes.numel()
    entropy = float(-(p[p > 0] * p[p > 0].log2()).sum())
    whole = q.nbytes
    scales = 8 * q.mins.numel()
    return {"bits": bits, "group": group_size or width, "bytes": whole, "scale_share": scales / whole,
            "bf16_scales": (whole - scales / 2) / whole, "entropy_bits": entropy,
            "entropy_coded": (whole - q.numel * (bits - entropy) / 8) / whole}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=256, help="a row's width (the WAN workload's hidden size)")
    ap.add_argument("--tokens", type=int, default=2048, help="rows in a message (a WAN step's 16 x 128 tokens)")
    ap.add_argument("--settings", default="2:64,3:row,4:row,8:row", help="bits:group (row: a whole row)")
    args = ap.parse_args(argv)
    print(f"rows of {args.width}, {args.tokens} rows a message")
    print("| bits | group | message bytes | scales' share | with bf16 scales | code entropy, bits | "
          "with codes entropy-coded | both |")
    print("|---|---|---|---|---|---|---|---|")
    out = []
    for setting in args.settings.split(","):
        bits, group = setting.split(":")
        row = price(int(bits), None if group == "row" else int(group), args.width, args.tokens)
        both = row["entropy_coded"] - (1 - row["bf16_scales"])
        print(f"| {row['bits']} | {row['group']} | {row['bytes']} | {row['scale_share']:.1%} | "
              f"{row['bf16_scales']:.3f}x | {row['entropy_bits']:.2f} | {row['entropy_coded']:.3f}x | {both:.3f}x |")
        out.append(row)
    return out


if __name__ == "__main__":
    main()
