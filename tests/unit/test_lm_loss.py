"""The last stage's causal-LM loss in chunks: HF's loss and gradients, without a micro-batch's full logits."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss

from aqpipe.pipeline.loading import build_stage
from aqpipe.pipeline.stages import lm_loss
from aqpipe.pipeline.stages.lm_loss import causal_lm_loss
from tests.helpers.host_reads import HostReads
from tests.helpers.lm_head import assert_no_targets_train_nothing, head_case

B, T, H, V = 2, 37, 16, 50


def case(seed: int = 0):
    return head_case(seed, (B, T, H, V))


@pytest.mark.parametrize("wrapped", [False, True], ids=["linear", "wrapped"])
@pytest.mark.parametrize("cap", [None, 3.0])
def test_chunked_loss_and_gradients_equal_hfs(cap, wrapped):
    """A plain Linear takes the gradients-in-the-forward Function; a head of another type (a Sequential here, as a
    wrapped head would be) the checkpointed chunks: both give HF's loss and gradients."""
    hidden, head, labels = case()
    logits = head(hidden)
    logits = torch.tanh(logits / cap) * cap if cap else logits
    want = ForCausalLMLoss(logits, labels, vocab_size=V)
    want_grads = torch.autograd.grad(want, [hidden, head.weight])
    call = torch.nn.Sequential(head) if wrapped else head
    got, got_logits, _ = causal_lm_loss(call, hidden, labels, V, cap, chunk_bytes=B * V * 4 * 5)  # 5 a chunk
    assert got_logits is None  # chunked: 8 chunks, the last of 2 positions
    grads = torch.autograd.grad(got, [hidden, head.weight])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        torch.testing.assert_close(causal_lm_loss(call, hidden, labels, V, cap, chunk_bytes=B * V * 4 * 5)[0], want)


@pytest.mark.parametrize("wrapped", [False, True], ids=["linear", "wrapped"])
def test_no_logits_are_kept_for_backward(wrapped):
    """A plain Linear's chunks keep their gradients, made in the forward; a head of another type (here a Sequential)
    keeps its checkpointed chunks' inputs (the hidden rows and targets) and recomputes their logits. Neither keeps a
    chunk's logits."""
    hidden, head, labels = case(1)
    head = torch.nn.Sequential(head) if wrapped else head
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(tuple(t.shape)) or t, lambda t: t):
        loss, _, _ = causal_lm_loss(head, hidden, labels, V, chunk_bytes=B * V * 4 * 5)
    loss.backward()
    assert kept and not [shape for shape in kept if shape and shape[-1] == V], kept


def test_small_logits_are_computed_whole_and_returned():
    hidden, head, labels = case(2)
    loss, logits, _ = causal_lm_loss(head, hidden, labels, V)
    assert logits is not None and logits.shape == (B, T, V)
    torch.testing.assert_close(loss, ForCausalLMLoss(head(hidden), labels, vocab_size=V), rtol=0, atol=0)


@pytest.mark.parametrize("chunk_bytes", [None, B * V * 4 * 5], ids=["whole", "chunked"])
def test_token_stats_count_the_targets_the_argmax_predicts_and_in_evaluation_their_entropy(chunk_bytes):
    hidden, head, labels = case(3)
    logits = head(hidden).detach()
    targets = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    kept = targets != -100
    labels[1, 10:20] = logits.argmax(-1)[1, 9:19]  # ten targets the model predicts, beside chance's
    targets = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    correct = int(((logits.argmax(-1) == targets) & kept).sum())
    assert correct >= 10
    p = logits[kept].softmax(-1)
    entropy = float(-(p * p.log()).sum())
    _, _, trained = causal_lm_loss(head, hidden, labels, V, chunk_bytes=chunk_bytes)
    assert trained.tolist() == [correct, 0.0]  # training: no entropy (it would cost a second softmax)
    with torch.no_grad():
        _, _, evaluated = causal_lm_loss(head, hidden, labels, V, chunk_bytes=chunk_bytes)
    assert evaluated[0] == correct and float(evaluated[1]) == pytest.approx(entropy, rel=1e-5)
    assert causal_lm_loss(head, hidden, None, V)[2] is None


def test_a_llama_last_stage_chunked_gives_todays_loss_and_gradients(monkeypatch):
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=300, tie_word_embeddings=True, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    results = []
    for chunk_bytes in (lm_loss.CHUNK_BYTES, 2 * 300 * 4 * 7):  # whole, then 7 positions a chunk
        monkeypatch.setattr(lm_loss, "CHUNK_BYTES", chunk_bytes)
        stage, _, _ = build_stage(LlamaForCausalLM, config, 0, 1, seed=4)
        out = stage(None, {"input_ids": ids, "labels": ids})
        out.loss.backward()
        results.append((out.loss.detach(), out.logits, {n: p.grad.clone() for n, p in stage.named_parameters()}))
    (whole, logits, g1), (chunked, none, g2) = results
    assert logits is not None and none is None
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=0)
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("chunk_bytes", [None, 2 * 50 * 4 * 3], ids=["whole", "chunked"])
def test_a_micro_batch_with_no_targets_has_a_zero_loss_and_no_gradient(chunk_bytes):
    """As Liger's fused loss has it (test_liger_loss.py): not 0/0, whose NaN would reject the step."""
    assert_no_targets_train_nothing(lambda head, hidden, labels: causal_lm_loss(head, hidden, labels, 50,
                                                                                 chunk_bytes=chunk_bytes)[0])


MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_, torch.ops.aten.bmm}


class Matmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket in MATMULS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("trains", [False, True], ids=["frozen", "trained"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("cap", [None, 3.0])
def test_a_linear_heads_gradients_are_made_in_its_forward_to_hfs_loss_gradients_and_token_counts(cap, bias, trains):
    """The loss's gradient made in the forward, then the gradients asked: the hidden states' and, where the head
    trains, its weight's and bias's. Two matmuls a chunk for LoRA's frozen head, three for a trained one, where
    checkpointed chunks take three and four; scaled in the backward by the loss's own (here 1.7)."""
    hidden, head, labels = head_case(4, (B, T, H, V), bias=bias)
    head.requires_grad_(trains)
    wrt = [hidden, *head.parameters()] if trains else [hidden]
    labels[1, 10:20] = head(hidden).argmax(-1)[1, 9:19]  # targets the argmax predicts, to count
    logits = head(hidden)
    logits = torch.tanh(logits / cap) * cap if cap else logits
    want = ForCausalLMLoss(logits, labels, vocab_size=V)
    want_grads = torch.autograd.grad(want * 1.7, wrt)
    with torch.no_grad():
        _, _, want_stats = causal_lm_loss(head, hidden, labels, V, cap, chunk_bytes=B * V * 4 * 5)
    with Matmuls() as counted:
        got, got_logits, stats = causal_lm_loss(head, hidden, labels, V, cap, chunk_bytes=B * V * 4 * 5)
        grads = torch.autograd.grad(got * 1.7, wrt)
    assert counted.count == (3 if trains else 2) * 8 and got_logits is None  # 8 chunks of 5 positions, the last 2
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for grad, want_grad in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6)
    assert stats[0] == want_stats[0] >= 10 and stats[1] == 0


def test_a_trained_heads_gradients_under_bf16_autocast_are_hfs_in_the_weights_dtype():
    """Under autocast the head computes in bf16 from float32 weights and hidden states (a float32-master model's
    residual stream): the weight's gradient summed over chunks in bf16 matmuls, returned float32 as the weight is,
    within bf16's rounding of what HF's loss gives under the same autocast."""
    hidden, head, labels = head_case(7, (B, T, H, V), bias=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ForCausalLMLoss(head(hidden), labels, vocab_size=V)
        got = causal_lm_loss(head, hidden, labels, V, chunk_bytes=B * V * 4 * 5)[0]
    want_grads = torch.autograd.grad(want, [hidden, head.weight, head.bias])
    grads = torch.autograd.grad(got, [hidden, head.weight, head.bias])
    torch.testing.assert_close(got, want, rtol=2e-3, atol=0)
    for grad, want_grad in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(grad, want_grad, rtol=2e-2, atol=2e-3)
    # scaled in float32: a bf16 gradient (the matmuls' sum) times the loss's gradient (1 / the target count), rounded
    # once to float32, not to bf16 first (autograd would cast a bf16 gradient to float32, exact in bf16)
    assert not torch.equal(grads[1], grads[1].bfloat16().float())


def test_a_bf16_heads_gradient_is_scaled_unrounded_then_rounded_once():
    """`--param_dtype bfloat16`: the weight's gradient, summed in bf16 over the chunks, times the loss's gradient (1.7 /
    the target count) in float32, the product rounded to bf16 once. Rounding the scale to bf16 first moves it."""
    hidden, head, labels = head_case(8, (B, T, H, V))
    head.bfloat16()
    hidden = hidden.detach().bfloat16().requires_grad_()
    count = int((torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:] != -100).sum())
    loss_of = lambda: causal_lm_loss(head, hidden, labels, V, chunk_bytes=B * V * 4 * 5)[0]  # noqa: E731
    (summed,) = torch.autograd.grad(loss_of() * count, [head.weight])  # the loss's gradient exactly 1: the bare sum
    (scaled,) = torch.autograd.grad(loss_of() * 1.7, [head.weight])
    assert scaled.dtype == torch.bfloat16
    assert torch.equal(scaled, (summed.float() * (torch.tensor(1.7) / count)).bfloat16())


def test_a_trained_head_over_hidden_states_that_need_no_gradient_runs_two_matmuls_a_chunk():
    """The first and only stage of a model whose blocks are frozen and head trains: the logits and the weight's
    gradient a chunk, no hidden states' gradient (checkpointed chunks: three)."""
    hidden, head, labels = head_case(9, (B, T, H, V))
    hidden = hidden.detach()
    want = ForCausalLMLoss(head(hidden), labels, vocab_size=V)
    (want_grad,) = torch.autograd.grad(want, [head.weight])
    with Matmuls() as counted:
        got = causal_lm_loss(head, hidden, labels, V, chunk_bytes=B * V * 4 * 5)[0]
        (grad,) = torch.autograd.grad(got, [head.weight])
    assert counted.count == 2 * 8
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6)


def test_a_frozen_heads_micro_batch_with_no_targets_has_a_zero_loss_and_gradient():
    hidden, head, labels = head_case(5, (2, 11, 16, 50), bias=True)
    head.requires_grad_(False)
    labels[:, 1:] = -100
    loss = causal_lm_loss(head, hidden, labels, 50, chunk_bytes=2 * 50 * 4 * 3)[0]
    (grad,) = torch.autograd.grad(loss, [hidden])
    assert loss.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad))


def test_a_head_whose_bias_alone_trains_gets_its_gradient_and_evaluation_its_entropies():
    """The gradients made in the forward are the ones asked: a bias's alone beside a frozen weight; evaluation (no
    autograd) keeps the chunks that compute the predicted distributions' entropies."""
    hidden, head, labels = head_case(6, (B, T, H, V), bias=True)
    head.weight.requires_grad_(False)
    loss = causal_lm_loss(head, hidden, labels, V, chunk_bytes=B * V * 4 * 5)[0]
    want = ForCausalLMLoss(head(hidden), labels, vocab_size=V)
    got_bias, want_bias = (torch.autograd.grad(x, [head.bias])[0] for x in (loss, want))
    torch.testing.assert_close(got_bias, want_bias, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        _, _, stats = causal_lm_loss(head.requires_grad_(False), hidden, labels, V, chunk_bytes=B * V * 4 * 5)
    assert stats[1] > 0  # the predicted distributions' entropies, summed


@pytest.mark.parametrize("trains", [False, True], ids=["frozen", "trained"])
def test_the_chunked_loss_and_its_backward_read_nothing_back_on_the_host(trains):
    """Item 3's rule for a last stage on a GPU: no `.item()`, no boolean index, no `nonzero` in the loss (ignored
    targets masked, not selected), so the host never waits for the device there."""
    hidden, head, labels = head_case(10, (B, T, H, V), bias=True)
    head.requires_grad_(trains)
    with HostReads() as seen:
        loss = causal_lm_loss(head, hidden, labels, V, 3.0, chunk_bytes=B * V * 4 * 5)[0]
        loss.backward()
    assert seen.reads == []
