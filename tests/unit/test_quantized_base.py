"""QLoRA's frozen base (aqpipe/pipeline/quantized_base.py): each stage holds its own blocks' linears in 4 bits,
quantized from its own tensors as they are read; embeddings, the tied head and norms stay in the checkpoint's
dtype; the adapters train on top through PEFT; a checkpoint holds none of the 4-bit base."""
import pytest
import torch
from bitsandbytes import functional as F
from bitsandbytes.nn import Linear4bit
from safetensors.torch import load_file
from transformers import AutoConfig, LlamaForCausalLM

from aqpipe.pipeline.adapters import LoraSettings, merged_state_dict
from aqpipe.pipeline.loading import CheckpointReader, build_stage
from aqpipe.pipeline.lora import add_lora, lora_config
from aqpipe.pipeline.quantized_base import FourBit, plain_state_dict
from tests.helpers.files import tiny_llama_dir

FOUR = FourBit("nf4", nested=True, compute_dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tiny_llama_dir(tmp_path_factory.mktemp("llama") / "model")
    stored = {}
    for shard in path.glob("*.safetensors"):
        stored.update(load_file(shard))
    return path, AutoConfig.from_pretrained(path), stored


def _stage(llama, index, four=FOUR):
    path, config, _ = llama
    reader = CheckpointReader(path)
    stage, _, _ = build_stage(LlamaForCausalLM, config, index, 2, reader=reader, dtype=torch.bfloat16, four_bit=four)
    return stage, reader


@pytest.mark.parametrize("index", [0, 1])
def test_a_stage_holds_its_block_linears_in_4_bits_from_its_own_tensors_and_the_rest_in_bf16(llama, index):
    stage, reader = _stage(llama, index)
    origin, stored = stage.hf_parameter_names(), llama[2]
    four = {path for path, m in stage.named_modules() if isinstance(m, Linear4bit)}
    linears = {path for path, m in stage.named_modules() if isinstance(m, torch.nn.Linear)}
    assert four and four == linears - {"lm_head"}  # every block linear, never the (tied) head
    for name, p in stage.named_parameters():
        if name.rpartition(".")[0] not in four:  # embeddings, norms, the head: the checkpoint's dtype
            assert p.dtype == torch.bfloat16, name
    plain = plain_state_dict(stage)
    for path in four:  # each weight its own stored tensor, as bitsandbytes quantizes and dequantizes it whole
        stored_weight = stored[origin[f"{path}.weight"]]
        want = F.dequantize_4bit(*F.quantize_4bit(stored_weight, quant_type="nf4", compress_statistics=True))
        got = plain[f"{path}.weight"]
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), path
        assert (got.float() - stored_weight.float()).norm() < 0.12 * stored_weight.float().norm(), path  # NF4's
    # read: this stage's tensors alone, each once (the other stage's blocks never)
    theirs = {n for n in stored if n.startswith(f"model.layers.{1 - index}.")}
    assert not theirs & set(reader.read) and len(reader.read) == len(set(reader.read))
    for path in four:  # half a byte a weight, packed; a scale per 64 weights, itself a byte (nested), and a
        w = stage.get_submodule(path).weight  # float32 scale per 256 of those
        n, qs = stored[origin[f"{path}.weight"]].numel(), w.quant_state
        assert w.dtype == torch.uint8 and w.numel() == n // 2, path
        assert qs.quant_type == "nf4" and qs.blocksize == 64 and qs.nested, path
        assert qs.absmax.dtype == torch.uint8 and qs.absmax.numel() == n // 64, path
        assert qs.state2.absmax.dtype == torch.float32 and qs.state2.absmax.numel() == -(-n // 64 // 256), path


def test_lora_wraps_the_4_bit_layers_trains_only_adapters_and_the_merge_is_dequantized_plus_delta(llama):
    stage, _ = _stage(llama, 0)
    config = lora_config(LlamaForCausalLM, llama[1], LoraSettings(rank=4, load_in_4bit=True), False, 2, "parameters")
    add_lora(stage, config, seed=0, dtype=torch.float32)
    trained = [n for n, p in stage.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n in trained)
    with torch.no_grad():
        for n, p in stage.named_parameters():
            if "lora_B" in n:
                p.normal_()
    q = stage.get_submodule("model.layers.0.self_attn.q_proj")
    merged = merged_state_dict(stage)
    base = F.dequantize_4bit(q.base_layer.weight.data, q.base_layer.weight.quant_state).float()
    assert torch.allclose(merged["model.layers.0.self_attn.q_proj.weight"], base + q.get_delta_weight("default"))
    assert not any(".absmax" in k or "quant_" in k for k in merged)  # the statistics are not model weights
    x = torch.randn(1, 8, 64, dtype=torch.bfloat16)
    out = q(x)
    out.float().sum().backward()
    assert q.lora_A["default"].weight.grad is not None and q.base_layer.weight.grad is None


def test_settings_refuse_a_4_bit_base_without_adapters_and_an_unknown_type():
    with pytest.raises(ValueError, match="--load_in_4bit without --lora_rank"):
        LoraSettings(load_in_4bit=True)
    with pytest.raises(ValueError, match="bnb_4bit_quant_type='int4': expected one of nf4, fp4"):
        LoraSettings(rank=4, load_in_4bit=True, bnb_4bit_quant_type="int4")
    with pytest.raises(ValueError, match="--use_bnb_nested_quant without --load_in_4bit"):
        LoraSettings(rank=4, use_bnb_nested_quant=True)


@pytest.mark.parametrize("quant_type,nested", [("nf4", True), ("nf4", False), ("fp4", True)])
def test_quantizing_a_chunk_at_a_time_gives_bitsandbytes_whole_tensor_result(quant_type, nested, monkeypatch):
    from aqpipe.pipeline import quantized_base

    monkeypatch.setattr(quantized_base, "CHUNK", 64 * 40)  # several chunks, the last a partial one
    torch.manual_seed(0)
    w = (torch.randn(96, 80) * 0.02).to(torch.bfloat16)
    packed, state = quantized_base.quantize(w, quant_type, nested)
    want, whole = F.quantize_4bit(w, quant_type=quant_type, compress_statistics=nested)
    assert torch.equal(packed, want) and torch.equal(state.absmax, whole.absmax)
    assert torch.equal(F.dequantize_4bit(packed, state), F.dequantize_4bit(want, whole))
    if nested:
        assert torch.equal(state.offset, whole.offset) and torch.equal(state.state2.absmax, whole.state2.absmax)


def test_gradients_still_flow_through_the_4_bit_layers_after_an_evaluation(llama):
    """bitsandbytes repacks a 4-bit weight for its CPU inference kernel the first time it runs in eval mode (on an
    AVX512-BF16 CPU) and never back; the training after an eval then had no gradient (the adapters froze)."""
    stage, _ = _stage(llama, 0)
    config = lora_config(LlamaForCausalLM, llama[1], LoraSettings(rank=4, load_in_4bit=True), False, 2, "parameters")
    add_lora(stage, config, seed=0, dtype=torch.float32)
    batch = {"input_ids": torch.randint(0, llama[1].vocab_size, (2, 16))}
    stage.eval()
    with torch.no_grad():
        stage(None, batch)
    stage.train()
    stage(None, batch).float().pow(2).mean().backward()
    grads = [p.grad for n, p in stage.named_parameters() if "lora_A" in n]  # lora_B starts at 0: A's grad is 0 too
    grads += [p.grad for n, p in stage.named_parameters() if "lora_B" in n]
    assert all(g is not None for g in grads) and all(float(g.abs().max()) > 0 for g in grads[len(grads) // 2:])


def test_a_packed_sample_through_4_bit_stages_gives_each_conversation_its_own_logits_and_adapter_gradients(llama):
    """QLoRA with packing: conversations packed into one sample through both 4-bit stages with adapters give each
    conversation the logits it gets alone, and the adapters the gradients of the conversations' summed losses."""
    from aqpipe.data.chat import IGNORE
    from aqpipe.data.packing import pack
    from tests.unit.test_packing import SEQ, conversations

    config = lora_config(LlamaForCausalLM, llama[1], LoraSettings(rank=4, load_in_4bit=True), False, 2, "parameters")
    stages = [_stage(llama, i)[0] for i in (0, 1)]
    for i, stage in enumerate(stages):
        add_lora(stage, config, seed=i, dtype=torch.float32)
        with torch.no_grad():
            for n, p in stage.named_parameters():
                if "lora_B" in n:
                    p.normal_(std=0.05)  # adapters that change the output, as after training
    adapters = [p for s in stages for n, p in s.named_parameters() if ".lora_" in n]

    def run(batch):
        return stages[1](stages[0](None, batch), batch)

    convs, starts = conversations(), {2: 0, 0: 9, 1: 16}  # where each sits in the packed sample (longest first)
    packed = pack(convs, SEQ, pad=0)
    out = run(packed)
    (out.loss * int((packed["labels"][:, 1:] != IGNORE).sum())).backward()
    packed_grads = [p.grad.clone() for p in adapters]
    for p in adapters:
        p.grad = None
    for k, (ids, labels) in enumerate(convs):
        alone = run({"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels])})
        at = starts[k]
        torch.testing.assert_close(out.logits[0, at:at + len(ids)].float(), alone.logits[0].float(), rtol=0,
                                   atol=2e-2)
        (alone.loss * sum(v != IGNORE for v in labels[1:])).backward()
    for p, packed_grad in zip(adapters, packed_grads):  # bf16 compute: 0.2-0.5% apart; attending across: more
        assert float((packed_grad - p.grad).norm() / p.grad.norm()) < 0.01


def test_the_nested_flag_reaches_every_4_bit_layer_as_the_trainer_builds_it_and_both_train(llama):
    """--use_bnb_nested_quant, through the trainer's build (settings -> build_engine): on, each scale of 64 weights is
    itself a byte (with a float32 scale per 256 of those); off, a float32 scale per 64 weights. The packed weights
    are the same either way, the statistics differ, and both bases train their adapters."""
    from aqpipe.models import resolve_model
    from aqpipe.data import load_tokenizer
    from aqpipe.pipeline import CompressionConfig
    from aqpipe.settings import build
    from aqpipe.train import build_engine
    from aqpipe.world import World
    from tests.helpers.reference import random_batches

    path, config, _ = llama
    built = {}
    for nested in (False, True):
        cfg = build("causal_lm", {"model": str(path), "seq_len": 12, "pipeline_stages": 1, "scheduler": None,
                                  "compression": CompressionConfig(), "micro_batch_size": 2, "num_micro_batches": 1,
                                  "lr": 1e-2, "lora": LoraSettings(rank=4, load_in_4bit=True,
                                                                   use_bnb_nested_quant=nested)})
        spec = resolve_model(str(path), "llama", "causal_lm", load_tokenizer(str(path)), 12, None, frozen=True)
        adapters = lora_config(spec.model_class, spec.config, cfg.lora, False, 1, cfg.distributed.partition)
        engine = build_engine(cfg, spec, World(0, 1, 0, torch.device("cpu")), 8, 4, adapters)
        four = {p: m.weight for p, m in engine.stage.named_modules() if isinstance(m, Linear4bit)}
        assert four and all(w.quant_state.nested == nested for w in four.values())
        losses = [engine.train_batch(step).loss for step in random_batches(4, 1, 2, 12, config.vocab_size)]
        b = [p for n, p in engine.stage.named_parameters() if "lora_B" in n]
        assert all(torch.isfinite(torch.tensor(losses))) and b and all(float(p.abs().max()) > 0 for p in b), losses
        built[nested] = four
    plain, nested = built[False], built[True]
    assert set(plain) == set(nested)
    for path_ in plain:
        a, b = plain[path_].quant_state, nested[path_].quant_state
        assert torch.equal(plain[path_].data, nested[path_].data)  # the same 4-bit codes
        assert a.absmax.dtype == torch.float32 and b.absmax.dtype == torch.uint8 and b.state2 is not None
        assert a.absmax.numel() == b.absmax.numel() == plain[path_].numel() * 2 // 64


def test_an_fp4_base_is_quantized_as_fp4(llama):
    """--bnb_4bit_quant_type fp4 reaches every 4-bit layer: its codes and statistics bitsandbytes' fp4's."""
    stage, _ = _stage(llama, 1, FourBit("fp4", nested=False, compute_dtype=torch.bfloat16))
    origin, stored = stage.hf_parameter_names(), llama[2]
    four = [(path, m) for path, m in stage.named_modules() if isinstance(m, Linear4bit)]
    assert four
    for path, module in four:
        assert module.weight.quant_state.quant_type == "fp4" and not module.weight.quant_state.nested, path
        want, _ = F.quantize_4bit(stored[origin[f"{path}.weight"]], quant_type="fp4")
        assert torch.equal(module.weight.data, want), path
