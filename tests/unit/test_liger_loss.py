"""--use_liger_kernel (HF's and TRL's flag): the last stage's causal-LM loss in training by Liger Kernel's fused
linear cross-entropy, which never builds the logits. Run here by Triton's CPU interpreter (the suite sets
TRITON_INTERPRET=1): its loss and gradients are HF's, a tied Llama stage's included; evaluation keeps the logits'
path; what it cannot run is refused in one line."""
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss

from aqpipe.environment import check_liger
from aqpipe.pipeline.loading import build_stage
from aqpipe.pipeline.stages.lm_loss import causal_lm_loss, fused_ready
from aqpipe.pipeline.step_table import StepTotals
from tests.helpers.lm_head import assert_no_targets_train_nothing, head_case

B, T, H, V = 2, 19, 16, 50


def case(seed: int = 0, bias: bool = False):
    return head_case(seed, (B, T, H, V), bias)


# Gemma's soft-capped logits: Triton's interpreter cannot run Liger's soft-capping kernel (it hands the kernel a Python
# float where a compiled launch has a scalar), so that case runs on a GPU (tests/gpu/test_cuda_path.py)
@pytest.mark.parametrize("cap,bias", [(None, False), (None, True)], ids=["plain", "bias"])
def test_the_fused_loss_and_its_gradients_are_hfs(cap, bias):
    hidden, head, labels = case(bias=bias)
    params = [hidden, *head.parameters()]
    logits = head(hidden)
    logits = torch.tanh(logits / cap) * cap if cap else logits
    want = ForCausalLMLoss(logits, labels, vocab_size=V)
    want_grads = torch.autograd.grad(want, params)
    got, got_logits, stats = causal_lm_loss(head, hidden, labels, V, cap, fused="liger")
    assert got_logits is None and stats is None  # no logits: no token accuracy in training
    grads = torch.autograd.grad(got, params)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_evaluation_keeps_the_logits_path_and_its_token_metrics():
    hidden, head, labels = case(1)
    with torch.no_grad():
        fused = causal_lm_loss(head, hidden, labels, V, fused="liger")
        plain = causal_lm_loss(head, hidden, labels, V)
    assert fused[1] is not None and torch.equal(fused[0], plain[0]) and torch.equal(fused[2], plain[2])


def llama() -> LlamaConfig:
    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, vocab_size=300, tie_word_embeddings=True, bos_token_id=0,
                       eos_token_id=0, pad_token_id=0)


def test_a_tied_llama_stage_trains_the_same_with_the_fused_loss_compiled_or_not():
    """--compile with it: the stage's graph calls the fused loss as it is (dynamo would trace into its kernels)."""
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    results = []
    for fused, compiled in ((None, False), ("liger", False), ("liger", True)):
        stage, _, _ = build_stage(LlamaForCausalLM, llama(), 0, 1, seed=4)
        stage.use_fused_loss(fused)
        if compiled:
            torch._dynamo.reset()
            stage.compile(backend="aot_eager")
        out = stage(None, {"input_ids": ids, "labels": ids})
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad.clone() for n, p in stage.named_parameters()}))
    torch._dynamo.reset()
    (plain, g1), *with_liger = results
    for fused, g2 in with_liger:
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)
        assert "model.embed_tokens.weight" in g2  # the tied weight: the head's gradient lands on the embedding's
        for name in g1:
            torch.testing.assert_close(g2[name], g1[name], rtol=1e-4, atol=1e-6, msg=name)


def test_what_it_cannot_run_is_refused_in_one_line(monkeypatch):
    with pytest.raises(ValueError, match="expected one of"):
        fused_ready("cut")
    adapted = get_peft_model(LlamaForCausalLM(llama()), LoraConfig(r=2, target_modules=["lm_head"]))
    with pytest.raises(ValueError, match="head is a .*Linear"):  # peft's lora.Linear: more than weight and bias
        fused_ready("liger", adapted.base_model.model.lm_head)
    with pytest.raises(ValueError, match="need a CUDA GPU"):
        check_liger(torch.device("cpu"), {})
    check_liger(torch.device("cpu"), {"TRITON_INTERPRET": "1"})
    monkeypatch.setitem(__import__("sys").modules, "liger_kernel.transformers", None)  # not installed
    with pytest.raises(ValueError, match="pip install liger-kernel"):
        fused_ready("liger")


def test_a_step_without_counted_predictions_reports_no_accuracy():
    assert StepTotals(target_tokens=40, token_correct=0, accuracy_tokens=0).token_accuracy() is None
    assert StepTotals(target_tokens=40, token_correct=10, accuracy_tokens=40).token_accuracy() == 0.25


def test_a_micro_batch_with_no_targets_has_a_zero_loss_and_no_gradient():
    """As the chunked and whole losses have it (test_lm_loss.py)."""
    assert_no_targets_train_nothing(lambda head, hidden, labels: causal_lm_loss(head, hidden, labels, 50,
                                                                                 fused="liger")[0])
