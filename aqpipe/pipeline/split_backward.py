"""A stage's backward in two parts (zb1): the input gradient now, the weight gradients later.

The previous stage waits for the input gradient; nobody waits for the weight gradients, so the
schedule runs them where the stage would otherwise idle. Nothing is computed twice:

1. `backward_input` walks the micro-batch's autograd graph from the output and marks the nodes on a
   path to the input (the *input path*). A node on it whose other inputs lead only to parameters
   (a matmul: its weight; a layer norm: its scale and shift) is a *split node*: autograd computes
   its input-path gradient now and leaves its parameter gradients out, as they lead to nothing
   asked for. A hook keeps the gradient that flows into each split node.
2. `WeightGradients.run` asks autograd, once per split node, for the gradients of its parameters
   from the kept gradient (its outputs as `GradientEdge`s): only the node's parameter side runs.
   Each call asks for that node's parameters alone, so autograd never walks back into the input
   path (which leads to other nodes' parameters) and recomputes nothing. They add into `.grad`.
   A parameter several split nodes lead to (DeBERTa's relative embeddings) is the exception: its
   nodes' parameters are computed in step 1's pass, so autograd sums it in its own order.

Every gradient is bit for bit what one backward gives (tests/unit/test_split_backward.py).

A stage whose output does not depend on an input that requires a gradient (the first stage)
has nothing to split: `backward_input` returns no gradient and `run` is the whole backward.

Memory: until `run`, the micro-batch's whole graph stays alive (every tensor its backward saved, also those only
the input part needed) plus one gradient per split node (for an LM head, one the size of the logits). A stage
that says `whole_backward` is not split (the engine runs its whole backward in the input part): with activation
checkpointing each `autograd.grad` call would recompute the checkpointed blocks again; Liger's fused loss scales
its saved gradients in place, so a second pass over its node would scale them twice.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


class WeightGradients:
    """The weight-gradient half of one micro-batch's backward; holds its graph until `run`."""

    def __init__(self, parts: list[tuple[Node, list[torch.Tensor], tuple[torch.Tensor | None, ...]]],
                 whole: tuple[torch.Tensor, torch.Tensor | None] | None = None,
                 ready: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None) -> None:
        self.parts, self.whole, self.ready = parts, whole, ready or []

    def run(self) -> None:
        """Add this micro-batch's parameter gradients into their `.grad`, then free its graph."""
        if self.whole is not None:
            output, grad = self.whole
            output.backward(grad)
        for p, g in self.ready:
            _accumulate(p, g)
        for node, params, grads in self.parts:
            edges = [GradientEdge(node, i) for i, g in enumerate(grads) if g is not None]
            given = [g for g in grads if g is not None]
            if not edges:
                continue
            for p, g in zip(params, torch.autograd.grad(edges, params, given, retain_graph=True, allow_unused=True)):
                _accumulate(p, g)
        self.parts, self.whole, self.ready = [], None, []


def _accumulate(p: torch.Tensor, g: torch.Tensor | None) -> None:
    """Hand the gradient to the parameter's own AccumulateGrad node, as a backward would: it copies a gradient it
    must not keep (shared with another parameter, broadcast, strided) and runs the parameter's hooks."""
    if g is not None:
        with torch.no_grad():
            get_gradient_edge(p).node(g)


def backward_input(output: torch.Tensor, grad: torch.Tensor | None, inputs: torch.Tensor | None,
                   params: list[torch.Tensor]) -> tuple[torch.Tensor | None, WeightGradients]:
    """The gradient of `inputs` (None where there are none or the output does not depend on them) and what
    computes the gradients of `params`."""
    params = [p for p in params if p.requires_grad]
    root = output.grad_fn
    if root is None or inputs is None or not inputs.requires_grad:
        return None, WeightGradients([], whole=(output, grad))
    target = get_gradient_edge(inputs).node
    param_of = {get_gradient_edge(p).node: p for p in params}
    children, order = _graph(root)
    on_path: dict[Node, bool] = {}
    below: dict[Node, list[torch.Tensor]] = {}  # the parameters each off-path node leads to
    for node in reversed(order):  # children before parents
        kids = children[node]
        on_path[node] = node is target or any(on_path[c] for c in kids)
        if not on_path[node]:
            own = [param_of[node]] if node in param_of else []
            below[node] = _unique([*own, *(p for c in kids for p in below[c])])
    if not on_path[root]:
        return None, WeightGradients([], whole=(output, grad))
    splits: list[tuple[Node, list[torch.Tensor]]] = []
    for node in order:
        if on_path[node] and node is not target:
            side = _unique(p for c in children[node] if not on_path[c] for p in below[c])
            if side:
                splits.append((node, side))
    # A parameter on the side of several split nodes (DeBERTa's relative embeddings, read by every layer) has its
    # gradient summed over them: autograd sums it in one order, separate calls in another. Those nodes' parameters
    # are computed now, in the input part's one pass, so every gradient stays bit for bit what one backward gives.
    uses = Counter(id(p) for _, side in splits for p in side)
    now = _unique(p for _, side in splits if any(uses[id(q)] > 1 for q in side) for p in side)
    later = [(node, side) for node, side in splits if all(uses[id(q)] == 1 for q in side)]
    kept: dict[Node, tuple[Any, ...]] = {}
    hooks = [node.register_prehook(_keeper(kept, node)) for node, _ in later]
    try:
        input_grad, *found = torch.autograd.grad(output, [inputs, *now], grad, retain_graph=True, allow_unused=True)
    finally:
        for h in hooks:
            h.remove()
    parts = [(node, side, kept[node]) for node, side in later if node in kept]
    return input_grad, WeightGradients(parts, ready=list(zip(now, found)))


def _keeper(kept: dict[Node, tuple[Any, ...]], node: Node) -> Any:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        kept[node] = tuple(grad_outputs)
    return hook


def _graph(root: Node) -> tuple[dict[Node, list[Node]], list[Node]]:
    """Each node's children (the nodes its gradients flow to) and the nodes parents-first (a topological order)."""
    children: dict[Node, list[Node]] = {}
    stack, post = [(root, False)], []
    while stack:
        node, done = stack.pop()
        if done:
            post.append(node)
            continue
        if node in children:
            continue
        children[node] = [n for n, _ in node.next_functions if n is not None]
        stack.append((node, True))
        stack.extend((c, False) for c in children[node] if c not in children)
    return children, post[::-1]


def _unique(params: Any) -> list[torch.Tensor]:
    out, seen = [], set()
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
