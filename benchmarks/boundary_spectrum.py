"""How much of a boundary's activation, and of its gradient, a rank-k subspace keeps on a pretrained start.

A codec below one value per element (issue: a wire a slow link can carry) sends a boundary's activations as k
coefficients in a basis both sides hold. Whether that can work is a property of the model, not the codec: the
share of the activations' energy in the top k directions, estimated on some samples and measured on others. The
backward sent in the same subspace keeps the part of the gradient inside it; that share is measured too, beside the
gradient's own top-k share (what a basis of its own would keep). The same for the token embeddings' output (a tied
weight's rows a step reads, and the gradient going back to the weight's owner), and, given the model after a
fine-tune (--tuned), for the tied embedding's change (what the tie's rows carry).

The model is split as the trainer splits it for 2 stages (by parameters); the basis is the uncentred second moment's
top eigenvectors over --fit samples, measured on --held_out other samples of the same corpus.

    python -m benchmarks.boundary_spectrum runs/wan/pretrain/model runs/wan/docstrings.txt \
        --tuned runs/wan/frontier/bf16/model --output benchmarks/results/boundary_spectrum.json
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from aqpipe.pipeline.partitioning import stage_block_counts

RANKS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def boundary_and_gradient(model: torch.nn.Module, tokens: torch.Tensor, stages: int = 2, at: str = "boundary"
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream the first stage hands on (tokens x width) and the loss's gradient with respect to it; with
    `at="embedding"`, the token embeddings' output instead (the rows of a tied weight a step reads, and the gradient
    that goes back to its owner)."""
    held: dict[str, torch.Tensor] = {}

    def keep(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        hidden.retain_grad()
        held["x"] = hidden

    where = model.get_input_embeddings() if at == "embedding" else \
        model.model.layers[stage_block_counts(model, stages)[0] - 1]
    handle = where.register_forward_hook(keep)
    try:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
    finally:
        handle.remove()
    x = held["x"]
    return x.detach().reshape(-1, x.shape[-1]).double(), x.grad.reshape(-1, x.shape[-1]).double()


def top_basis(rows: torch.Tensor) -> torch.Tensor:
    """The uncentred second moment's eigenvectors, largest first (width x width)."""
    values, vectors = torch.linalg.eigh(rows.T @ rows)
    return vectors[:, values.argsort(descending=True)]


def kept(rows: torch.Tensor, basis: torch.Tensor) -> tuple[float, float]:
    """The share of `rows`' energy inside `basis`'s span, over all rows and at the worst-kept 5% of rows."""
    inside = (rows @ basis).square().sum(dim=1)
    total = rows.square().sum(dim=1).clamp_min(1e-300)
    return float(inside.sum() / total.sum()), float((inside / total).quantile(0.05))


def spectrum(model: torch.nn.Module, fit: torch.Tensor, held_out: torch.Tensor, at: str = "boundary"
             ) -> dict[str, Any]:
    x_fit, g_fit = boundary_and_gradient(model, fit, at=at)
    model.zero_grad(set_to_none=True)
    x, g = boundary_and_gradient(model, held_out, at=at)
    model.zero_grad(set_to_none=True)
    act_basis, grad_basis = top_basis(x_fit), top_basis(g_fit)
    width = x.shape[1]
    rows = []
    for k in (r for r in RANKS if r <= width):
        act, act_p5 = kept(x, act_basis[:, :k])
        grad_in_act, _ = kept(g, act_basis[:, :k])
        grad_own, _ = kept(g, grad_basis[:, :k])
        rows.append({"k": k, "k_over_width": k / width, "activation": act, "activation_p5": act_p5,
                     "gradient_in_activation_basis": grad_in_act, "gradient_own_basis": grad_own})
    return {"width": width, "tokens_fit": x_fit.shape[0], "tokens_held_out": x.shape[0], "ranks": rows}


def change_spectrum(before: torch.nn.Module, after: torch.nn.Module) -> dict[str, Any]:
    """What a fine-tune changed in the tied embedding, row by row (the tie's rows travel as changes): the share of
    its energy in the top k directions, estimated on half the rows and measured on the other half."""
    change = (after.get_input_embeddings().weight - before.get_input_embeddings().weight).detach().double()
    order = torch.randperm(change.shape[0], generator=torch.Generator().manual_seed(0))
    half = change.shape[0] // 2
    basis = top_basis(change[order[:half]])
    return {"relative_change": float(change.norm() / before.get_input_embeddings().weight.detach().double().norm()),
            "ranks": [{"k": k, "change": kept(change[order[half:]], basis[:, :k])[0]}
                      for k in RANKS if k <= change.shape[1]]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a model directory (bf16 safetensors, as the trainer reads it)")
    p.add_argument("corpus", help="a text file: the fine-tuning corpus")
    p.add_argument("--fit", type=int, default=64, help="samples the basis is estimated on")
    p.add_argument("--held_out", type=int, default=64, help="other samples it is measured on")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--tuned", help="the same model after a fine-tune (its export): how low-rank the tied "
                   "embedding's change is")
    p.add_argument("--output", help="also write the figures here (json)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    need = (args.fit + args.held_out) * args.seq_len
    ids = tokenizer(open(args.corpus, encoding="utf-8").read()[: need * 8])["input_ids"]
    if len(ids) < need:
        print(f"boundary_spectrum: {args.corpus} has {len(ids)} tokens; --fit and --held_out need {need}",
              file=sys.stderr)
        return 2
    tokens = torch.tensor(ids[:need]).view(-1, args.seq_len)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    out = {"pretrained": spectrum(model, tokens[:args.fit], tokens[args.fit:])}
    fresh = AutoModelForCausalLM.from_config(model.config)  # the same shape at initialisation, for contrast
    out["initialisation"] = spectrum(fresh, tokens[:args.fit], tokens[args.fit:])
    out["embedding"] = spectrum(model, tokens[:args.fit], tokens[args.fit:], at="embedding")
    for name, block in out.items():
        print(f"{name} (width {block['width']}): k, activation energy kept (held out; worst 5% of tokens), "
              "gradient kept in that basis, gradient in its own")
        for r in block["ranks"]:
            print(f"  k={r['k']:4d} ({r['k_over_width']:.3f})  act {r['activation']:.4f} ({r['activation_p5']:.4f})"
                  f"  grad {r['gradient_in_activation_basis']:.4f}  own {r['gradient_own_basis']:.4f}")
    if args.tuned:
        out["tied_change"] = change_spectrum(model, AutoModelForCausalLM.from_pretrained(args.tuned,
                                                                                        dtype=torch.float32))
        print(f"tied embedding's change after the fine-tune ({out['tied_change']['relative_change']:.3f} of its "
              "norm): k, energy kept on the held-out rows")
        for r in out["tied_change"]["ranks"]:
            print(f"  k={r['k']:4d}  {r['change']:.4f}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
