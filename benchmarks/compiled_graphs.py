"""How much of a stage `--compile` compiles: the graphs torch.compile's front end (dynamo) captures for each stage's
training forward, called as the engine calls it (a staged micro-batch, the step's dropout seed) and backwarded, and
the ops in them, beside the same model compiled whole as a plain loop compiles it (`torch.compile(model)`, its head
and loss inside). A counting backend captures them; no compiler runs, so a CPU answers in seconds, and a GPU's would
be the same graphs. Printed per run: graphs (frames), and their top-level ops (a checkpointed region, such as a chunk
of the chunked loss, counts as one). The goal is one graph a stage holding its share of the model.

    python -m benchmarks.compiled_graphs                         # step_overhead's 1b shape's depth, at width 64
    python -m benchmarks.compiled_graphs --stages 4              # the same model at 4 stages (split by parameters:
                                                                 # at width 64 the tied embedding weighs 7 blocks)
"""
from __future__ import annotations

import argparse

import torch
from torch._dynamo.testing import CompileCounter
from transformers import LlamaConfig, LlamaForCausalLM

from aqpipe.pipeline.loading import build_stage
from aqpipe.pipeline.micro_batch import staged
from benchmarks.step_overhead import SHAPES


def _config(shape: str, width: int) -> LlamaConfig:
    sizes = dict(SHAPES[shape])
    if width:  # the shape's depth and heads at a narrower width: the graphs are the same, the arithmetic less
        sizes.update(hidden_size=width, intermediate_size=4 * width)
    return LlamaConfig(**sizes, vocab_size=50257, tie_word_embeddings=True)


def _captured(fn, *args) -> tuple[int, int]:
    """Frames and ops torch.compile captures for the loss `fn(backend)` returns, called and backwarded twice (a
    second call that recompiled would add frames)."""
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = fn(counter)
    for _ in range(2):
        compiled(*args).backward()
    torch._dynamo.reset()
    return counter.frame_count, counter.op_count


def _plain(config: LlamaConfig, batch: dict, backend: CompileCounter):
    """The unpartitioned model compiled whole, as step_overhead's compiled plain loop runs it: its loss."""
    torch.manual_seed(0)
    compiled = torch.compile(LlamaForCausalLM(config).train(), backend=backend)
    return lambda: compiled(**batch).loss


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    p.add_argument("--width", type=int, default=64, help="hidden size in place of the shape's (0: the shape's own)")
    p.add_argument("--stages", type=int, default=1)
    p.add_argument("--micro_batch_size", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=1024)
    args = p.parse_args(argv)
    config = _config(args.shape, args.width)
    ids = torch.randint(0, config.vocab_size, (args.micro_batch_size, args.seq_len),
                        generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    print(f"{args.shape} shape, width {config.hidden_size}, {config.num_hidden_layers} blocks, "
          f"{args.micro_batch_size} x {args.seq_len} tokens a micro-batch")
    print("| run | graphs | ops |\n|---|---|---|")
    frames, ops = _captured(lambda backend: _plain(config, batch, backend))
    print(f"| plain model, torch.compile(model) | {frames} | {ops} |")
    for index in range(args.stages):
        stage = build_stage(LlamaForCausalLM, config, index, args.stages, seed=4)[0].train()
        micro_batch = staged([batch], "cpu")[0]
        inputs = None if index == 0 else \
            torch.randn(*ids.shape, config.hidden_size, requires_grad=True)  # a boundary's activation (its values
        # do not change the graphs)

        def call(backend, stage=stage, inputs=inputs, micro_batch=micro_batch):
            stage.compile(backend=backend)
            return lambda: (stage(inputs, micro_batch, seed=123).loss if stage.is_last else
                            stage(inputs, micro_batch, seed=123).sum())
        frames, ops = _captured(call)
        print(f"| aqpipe stage {index} of {args.stages}, --compile | {frames} | {ops} |")
        del stage
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
