"""zb1's backward in two parts: the same gradients as one backward, bit for bit, and no work done twice."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from aqpipe.pipeline import partition
from aqpipe.pipeline.split_backward import backward_input
from aqpipe.pipeline.stages import lm_loss
from tests.unit.test_partition import make_batch, make_model

CHUNKED = 2_000  # the float32 logits a chunk may hold where the tied head's loss is chunked


def stage_inputs(stages, batch):
    """Each stage's input as the engine holds it: the previous stage's output, detached, requiring a gradient."""
    hidden, inputs = None, []
    with torch.no_grad():
        for stage in stages[:-1]:
            inputs.append(hidden)
            hidden = stage(hidden, batch)
    return inputs + [hidden]


def grads(stage, hidden, batch, grad_out, split):
    """The input's and every parameter's gradient of one micro-batch, by one backward or by the split one."""
    torch.manual_seed(7)  # the same dropout draws in both runs
    stage.zero_grad(set_to_none=True)
    x = None if hidden is None else hidden.clone().requires_grad_(True)
    out = stage(x, batch)
    out = out.loss if stage.is_last else out
    if stage.is_last and lm_loss.CHUNK_BYTES == CHUNKED:  # the chunked head's node is on the graph, not checkpoints
        assert "LinearCrossEntropyBackward" in {type(f).__name__ for f, _ in out.grad_fn.next_functions}
    if not split:
        out.backward(grad_out)
        return (None if x is None else x.grad), {n: p.grad for n, p in stage.named_parameters()}
    x_grad, weights = backward_input(out, grad_out, x, list(stage.parameters()))
    held = [n for n, p in stage.named_parameters() if p.grad is not None]
    weights.run()
    return x_grad, {n: p.grad for n, p in stage.named_parameters()}, held


@pytest.mark.parametrize("kind,checkpointing", [("gpt2_lm", False), ("gpt2_cls", False), ("deberta", False),
                                                ("deberta_v2", False), ("gpt2_lm", True), ("deberta_v2", True),
                                                ("gpt2_lm_chunked", False)])
def test_split_backward_gives_one_backwards_gradients_bit_for_bit(kind, checkpointing, monkeypatch):
    if kind == "gpt2_lm_chunked":  # the tied head's loss in chunks, its gradients made in the forward: one node
        kind = "gpt2_lm"  # that zb1's two parts both run, from the same saved gradients
        monkeypatch.setattr(lm_loss, "CHUNK_BYTES", CHUNKED)
    model = make_model(kind)
    stages = partition(model, 3, activation_checkpointing=checkpointing)
    for stage in stages:
        stage.train()
    batch = make_batch(kind)
    inputs = stage_inputs(stages, batch)
    for stage, hidden in zip(stages, inputs):
        grad_out = None if stage.is_last else torch.randn(hidden.shape if hidden is not None else
                                                          (*batch["input_ids"].shape, stage.hidden_size))
        want_x, want = grads(stage, hidden, batch, grad_out, split=False)
        got_x, got, held = grads(stage, hidden, batch, grad_out, split=True)
        assert set(got) == set(want)
        for name in want:
            assert want[name] is not None and torch.equal(got[name], want[name]), name
        if hidden is None:  # the first stage: nothing to split, the whole backward runs later
            assert got_x is None
        else:
            assert torch.equal(got_x, want_x)
        if hidden is not None:  # no weight gradient before its part runs
            assert held == []


def test_split_backward_computes_nothing_twice():
    """The input part and the weight part together count the floating-point work of one backward."""
    model = make_model("gpt2_lm")
    stage = partition(model, 2)[1]
    batch = make_batch("gpt2_lm")
    hidden = stage_inputs(partition(model, 2), batch)[1]

    def flops(split):
        x = hidden.clone().requires_grad_(True)
        loss = stage(x, batch).loss
        with FlopCounterMode(display=False) as counter:
            if split:
                _, weights = backward_input(loss, None, x, list(stage.parameters()))
                weights.run()
            else:
                loss.backward()
        return counter.get_total_flops()

    whole = flops(False)
    assert whole > 0 and flops(True) == whole


def test_the_weight_part_is_exactly_the_weight_gradients_matmuls():
    """What the previous stage waits for is the input part only: the weight part holds every weight matrix's
    gradient product (2 x tokens x its size in floating-point operations, GPT2's Conv1D and the LM head) and
    nothing else, and the input part the rest of the backward."""
    from transformers.pytorch_utils import Conv1D

    model = make_model("gpt2_lm", layers=4)
    stage = partition(model, 2)[1]
    batch = make_batch("gpt2_lm")
    hidden = stage_inputs(partition(model, 2), batch)[1]
    x = hidden.clone().requires_grad_(True)
    loss = stage(x, batch).loss
    with FlopCounterMode(display=False) as whole:
        loss.backward(retain_graph=True)
    stage.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as first:
        _, weights = backward_input(loss, None, x, list(stage.parameters()))
    with FlopCounterMode(display=False) as second:
        weights.run()
    tokens = batch["input_ids"].numel()
    matrices = [m.weight for m in stage.modules() if isinstance(m, (Conv1D, torch.nn.Linear))]
    expected = sum(2 * tokens * w.numel() for w in matrices)
    i, w = first.get_total_flops(), second.get_total_flops()
    assert len(matrices) == 2 * 4 + 1 and w == expected  # 2 blocks x (attention in, out, MLP in, out) + the head
    assert i == whole.get_total_flops() - expected and i > 0


def test_gradients_shared_between_parameters_are_not_added_twice():
    """Two biases that get the same gradient tensor: accumulated over two micro-batches each keeps its own sum."""
    b1, b2 = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    w = torch.nn.Parameter(torch.ones(3))
    for _ in range(2):
        x = torch.ones(3, requires_grad=True)
        h = x * w
        out = ((h + b1) + (h + b2)).sum()
        _, weights = backward_input(out, None, x, [w, b1, b2])
        weights.run()
    assert torch.equal(b1.grad, torch.full((3,), 2.0)) and torch.equal(b2.grad, torch.full((3,), 2.0))
    assert torch.equal(w.grad, torch.full((3,), 4.0))
