"""pipeline.partitioning: stages run in turn reproduce the HF model's loss and gradients; balancing; ties; merging."""
from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.utils.checkpoint
from transformers import (
    DebertaConfig,
    DebertaForSequenceClassification,
    DebertaV2Config,
    DebertaV2ForSequenceClassification,
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    GPT2Model,
)

from aqpipe.pipeline import Tie
from aqpipe.pipeline.partitioning import (
    PipelineStage,
    StageOutput,
    balance_by_size,
    merge_into,
    partition,
    stage_block_counts,
    tie_groups,
)
from tests.helpers.host_reads import HostReads

KINDS = ["gpt2_lm", "gpt2_cls", "deberta", "deberta_v2"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add overhead (10x on a busy 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

B, T, VOCAB, PAD, LABELS = 3, 16, 100, 0, 3


def config(kind: str, vocab: int = VOCAB, layers: int = 4, attn: str | None = None):
    if kind.startswith("gpt2"):
        cfg = GPT2Config(vocab_size=vocab, n_positions=32, n_embd=64, n_layer=layers, n_head=4, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2, num_labels=LABELS,
                         pad_token_id=PAD if kind == "gpt2_cls" else None)
        if attn:
            cfg._attn_implementation = attn
        return cfg
    common = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, pooler_dropout=0.0, relative_attention=True,
                  pos_att_type=["c2p", "p2c"], num_labels=LABELS, pad_token_id=PAD)
    if kind == "deberta":
        return DebertaConfig(**common, max_relative_positions=16)
    # DeBERTa-v3 style: log-bucketed positions, shared keys, LayerNorm'd relative embeddings, conv after layer 0
    return DebertaV2Config(**common, max_relative_positions=32, position_buckets=8, share_att_key=True,
                           norm_rel_ebd="layer_norm", conv_kernel_size=3, type_vocab_size=2)


MODEL_CLASSES = {"gpt2_lm": GPT2LMHeadModel, "gpt2_cls": GPT2ForSequenceClassification,
                 "deberta": DebertaForSequenceClassification, "deberta_v2": DebertaV2ForSequenceClassification}


def make_model(kind: str, seed: int = 0, **kw):
    torch.manual_seed(seed)
    model = MODEL_CLASSES[kind](config(kind, **kw))
    # Random, non-zero biases and LayerNorm affines, so that every parameter gets a non-trivial gradient.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.train()


def make_batch(kind: str, seed: int = 1, padding: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    if padding:  # right padding of different lengths
        mask[1, 11:] = 0
        mask[2, 6:] = 0
        ids[mask == 0] = PAD
    batch = {"input_ids": ids, "attention_mask": mask}
    if kind == "gpt2_lm":
        labels = ids.clone()
        labels[mask == 0] = -100
        batch["labels"] = labels
    else:
        batch["labels"] = torch.tensor([0, 2, 1])
    if kind == "deberta_v2":
        batch["token_type_ids"] = (torch.arange(T) >= T // 2).long().expand(B, T).clone()
    return batch


def run(stages: list[PipelineStage], batch: dict[str, torch.Tensor]) -> StageOutput:
    hidden = None
    for stage in stages:
        out = stage(hidden, batch)
        if stage.is_last:
            assert isinstance(out, StageOutput)
            return out
        assert isinstance(out, torch.Tensor) and out.shape == (B, T, stage.hidden_size)
        hidden = out
    raise AssertionError("no last stage")


def summed_stage_grads(model, stages) -> dict[int, torch.Tensor]:
    """id(HF parameter) -> sum of the grads of every stage parameter carrying that HF name (tied copies summed)."""
    hf = dict(model.named_parameters(remove_duplicate=False))
    total: dict[int, torch.Tensor] = {}
    for stage in stages:
        for name, p in stage.named_parameters():
            assert name in hf, f"stage {stage.stage_index} parameter {name!r} is not an HF name"
            assert p.grad is not None, f"stage {stage.stage_index}: no gradient for {name}"
            key = id(hf[name])
            total[key] = total[key] + p.grad if key in total else p.grad.clone()
    return total


def assert_close_rel(got: torch.Tensor, ref: torch.Tensor, rel: float, what: str) -> None:
    err = (got - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= rel * scale + 1e-9, f"{what}: max error {err:.3g} vs scale {scale:.3g}"


def assert_matches_hf(model, stages, batch) -> None:
    model.zero_grad(set_to_none=True)
    ref = model(**batch)
    ref.loss.backward()
    out = run(stages, batch)
    out.loss.backward()
    assert out.loss.dim() == 0
    assert abs(out.loss.item() - ref.loss.item()) <= 1e-5 * abs(ref.loss.item()), (out.loss.item(), ref.loss.item())
    assert_close_rel(out.logits, ref.logits, 1e-5, "logits")
    grads = summed_stage_grads(model, stages)
    for name, p in model.named_parameters():
        assert id(p) in grads, f"no stage holds {name}"
        assert p.grad is not None and p.grad.abs().max() > 0, f"HF gradient of {name} is zero: test would be vacuous"
        assert_close_rel(grads[id(p)], p.grad, 1e-5, name)


# ---------------------------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("num_stages", [1, 2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_stages_match_hf_loss_and_grads(kind, num_stages):
    model = make_model(kind)
    stages = partition(model, num_stages)
    assert [s.stage_index for s in stages] == list(range(num_stages))
    assert stages[0].is_first and stages[-1].is_last
    assert sum(len(s.block_indices) for s in stages) == 4
    assert_matches_hf(model, stages, make_batch(kind))


@pytest.mark.parametrize("kind", KINDS)
def test_pretrained_weights_path(kind, tmp_path):
    make_model(kind, seed=5).save_pretrained(tmp_path)
    model = MODEL_CLASSES[kind].from_pretrained(tmp_path)
    assert not model.training  # from_pretrained gives eval mode; the stages must follow
    for num_stages in (2, 3):
        stages = partition(model, num_stages)
        assert all(not s.training for s in stages)
        assert_matches_hf(model, stages, make_batch(kind, seed=num_stages))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("padding", [True, False])
def test_gpt2_attention_implementations_and_causality(attn, padding):
    model = make_model("gpt2_lm", attn=attn)
    assert model.config._attn_implementation == attn
    stages = partition(model, 3, method=[1, 2, 1])
    batch = make_batch("gpt2_lm", padding=padding)
    assert_matches_hf(model, stages, batch)
    # Middle stages must stay causal: changing the last token changes no earlier logit.
    with torch.no_grad():
        a = run(stages, batch).logits
        changed = dict(batch, input_ids=batch["input_ids"].clone())
        changed["input_ids"][:, -1] = (changed["input_ids"][:, -1] + 7) % VOCAB
        b = run(stages, changed).logits
    assert torch.equal(a[:, :-1], b[:, :-1])
    assert not torch.equal(a[0, -1], b[0, -1])


@pytest.mark.parametrize("kind", ["deberta", "deberta_v2"])
def test_deberta_without_attention_mask(kind):
    model = make_model(kind)
    stages = partition(model, 2)
    batch = make_batch(kind, padding=False)
    del batch["attention_mask"]
    assert_matches_hf(model, stages, batch)


@pytest.mark.parametrize("labels", [[2, -100, -1], [-0.5, 1.0, 2.0]])  # a float label below 0 is none, as HF's
@pytest.mark.parametrize("kind", ["deberta", "deberta_v2"])
def test_deberta_leaves_unlabelled_rows_out_as_hf_does_without_reading_them_back(kind, labels):
    """HF's DeBERTa head picks its labelled rows (label >= 0) by `nonzero`, which waits for the GPU every
    micro-batch; the stage takes the same mean by a mask, and no labelled row is a loss of 0, as HF's. (v1's blocks
    still read their attention span back, as a Python number: HF's code, left as it is.)"""
    model = make_model(kind)
    stages = partition(model, 2)
    batch = dict(make_batch(kind), labels=torch.tensor(labels))
    assert_matches_hf(model, stages, batch)
    with HostReads() as seen:
        run(stages, batch)
    assert set(seen.reads) == {"deberta": {"_local_scalar_dense"}, "deberta_v2": set()}[kind]
    out = run(stages, dict(batch, labels=torch.full((3,), -100)))
    out.loss.backward()
    assert out.loss.item() == 0.0 == model(**dict(batch, labels=torch.full((3,), -100))).loss.item()

def test_gpt2_cls_pools_last_non_pad_token():
    model = make_model("gpt2_cls").eval()
    stages = partition(model, 2)
    batch = make_batch("gpt2_cls")
    with torch.no_grad():
        out = run(stages, batch)
        hidden = model.transformer(batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    expected = model.score(hidden)[torch.arange(B), torch.tensor([T - 1, 10, 5])]
    assert out.logits.shape == (B, LABELS)
    assert_close_rel(out.logits, expected, 1e-5, "pooled logits")


def test_last_stage_without_labels_returns_logits_only():
    model = make_model("deberta_v2").eval()
    stages = partition(model, 2)
    batch = make_batch("deberta_v2")
    del batch["labels"]
    with torch.no_grad():
        out = run(stages, batch)
        ref = model(**batch)
    assert out.loss is None
    assert_close_rel(out.logits, ref.logits, 1e-5, "logits")


# ---------------------------------------------------------------------------------------------- structure
@pytest.mark.parametrize("kind", KINDS)
def test_stage_attributes_names_and_independence(kind):
    model = make_model(kind)
    stages = partition(model, 3)
    expected = {k: v.clone() for k, v in model.state_dict().items()}  # clones: state_dict() shares storage
    seen: set[str] = set()
    for s in stages:
        assert s.num_stages == 3 and s.hidden_size == 64
        assert s.is_first == (s.stage_index == 0) and s.is_last == (s.stage_index == 2)
        sd = s.hf_state_dict()
        for k, v in sd.items():
            assert k in expected, k
            assert torch.equal(v, expected[k]), k
        seen |= set(sd)
    assert seen == set(expected)
    # Independent copies: changing a stage does not touch the model or another stage.
    others = [{k: v.clone() for k, v in stages[i].hf_state_dict().items()} for i in (0, 2)]
    with torch.no_grad():
        for p in stages[1].parameters():
            p.add_(1.0)
    assert all(not torch.equal(v, expected[k]) for k, v in stages[1].hf_state_dict().items())
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    for i, before in zip((0, 2), others):
        assert all(torch.equal(v, before[k]) for k, v in stages[i].hf_state_dict().items())
    for key, tie in tie_groups(stages).items():
        a, b = (stages[i].tied_parameters()[key] for i in tie.holders[:2])
        assert a is not b
    with pytest.raises(ValueError, match="hidden=None"):
        stages[0](torch.zeros(B, T, 64), make_batch(kind))


def test_tie_groups():
    lm = partition(make_model("gpt2_lm"), 3)
    # stage 0 looks rows up (by input_ids and token_type_ids); the LM head on stage 2 uses them all and owns it
    assert tie_groups(lm) == {"transformer.wte.weight": Tie((0, 2), {0: ("input_ids", "token_type_ids")})}
    assert tie_groups(lm)["transformer.wte.weight"].owner == 2
    assert tie_groups(lm)["transformer.wte.weight"].followers == (0,)
    assert set(lm[1].tied_parameters()) == set()
    assert lm[2].tied_parameters()["transformer.wte.weight"] is lm[2].lm_head.weight
    assert lm[0].tied_parameters()["transformer.wte.weight"] is lm[0].transformer.wte.weight
    single = partition(make_model("gpt2_lm"), 1)[0]
    assert single.lm_head.weight is single.transformer.wte.weight  # tied inside one stage, as in HF
    assert tie_groups([single]) == {}
    assert tie_groups(partition(make_model("gpt2_cls"), 3)) == {}
    deberta = tie_groups(partition(make_model("deberta"), 3))
    assert deberta == {"deberta.encoder.rel_embeddings.weight": Tie((0, 1, 2))}  # every stage uses all rows
    assert deberta["deberta.encoder.rel_embeddings.weight"].followers == (0, 1)
    v2 = tie_groups(partition(make_model("deberta_v2"), 2))
    assert v2 == {k: Tie((0, 1)) for k in ("deberta.encoder.rel_embeddings.weight", "deberta.encoder.LayerNorm.weight",
                                      "deberta.encoder.LayerNorm.bias")}


def test_unsupported_model_names_class_and_supported_ones():
    with pytest.raises(ValueError, match=r"^cannot partition GPT2Model: supported model classes are .*"
                                         r"DebertaV2ForSequenceClassification.*GPT2LMHeadModel.*LlamaForCausalLM.*"
                                         r"Qwen3ForSequenceClassification, RobertaForSequenceClassification$"):
        partition(GPT2Model(config("gpt2_lm")), 2)


# ---------------------------------------------------------------------------------------------- balancing
def brute_force(sizes, num_stages, first, last):
    best = None
    for cuts in itertools.combinations(range(1, len(sizes)), num_stages - 1):
        bounds = (0, *cuts, len(sizes))
        costs = [sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:])]
        costs[0] += first
        costs[-1] += last
        key = (max(costs), sum(c * c for c in costs))
        best = key if best is None or key < best else best
    return best


def costs_of(counts, sizes, first, last):
    bounds = [0, *itertools.accumulate(counts)]
    costs = [sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:])]
    costs[0] += first
    costs[-1] += last
    return costs


def test_balance_by_size_small_cases_and_brute_force():
    assert balance_by_size([1] * 6, 3) == [2, 2, 2]
    assert balance_by_size([1] * 6, 3, first_extra=3) == [1, 2, 3]
    assert balance_by_size([1] * 6, 3, last_extra=3) == [2, 3, 1]
    assert balance_by_size([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        s = rng.randint(1, n)
        sizes = [rng.randint(1, 20) for _ in range(n)]
        first, last = rng.randint(0, 40), rng.randint(0, 40)
        counts = balance_by_size(sizes, s, first, last)
        assert len(counts) == s and sum(counts) == n and min(counts) >= 1
        costs = costs_of(counts, sizes, first, last)
        assert (max(costs), sum(c * c for c in costs)) == brute_force(sizes, s, first, last)


def test_block_counts_by_method():
    # GPT-2 LM, vocab 1000: wte+wpe (66,048) on stage 0, ln_f + the lm_head copy (64,128) on the last stage,
    # 49,984 per block. 3 stages: [1, 2, 1] has max 116,032; uniform [2, 1, 1] would put 166,016 on stage 0.
    lm = make_model("gpt2_lm", vocab=1000)
    assert sum(p.numel() for p in lm.transformer.h[0].parameters()) == 49_984
    assert stage_block_counts(lm, 3, "parameters") == [1, 2, 1]
    assert stage_block_counts(lm, 3, "uniform") == [2, 1, 1]
    assert stage_block_counts(lm, 2, "parameters") == [2, 2]
    assert [len(s.block_indices) for s in partition(lm, 3)] == [1, 2, 1]
    assert [s.block_indices for s in partition(lm, 3, "uniform")] == [[0, 1], [2], [3]]
    # DeBERTa, vocab 1000: embeddings (68,224) on stage 0, a small pooler + classifier (4,355) on the last.
    deb = make_model("deberta", vocab=1000)
    assert stage_block_counts(deb, 2, "parameters") == [1, 3]
    assert stage_block_counts(deb, 2, "uniform") == [2, 2]
    assert [s.block_indices for s in partition(deb, 2, [3, 1])] == [[0, 1, 2], [3]]
    assert stage_block_counts(make_model("gpt2_cls", layers=7), 3, "uniform") == [3, 2, 2]
    assert stage_block_counts(lm, 4, "parameters") == [1, 1, 1, 1]


@pytest.mark.parametrize(
    "num_stages, method, message",
    [
        (0, "uniform", r"num_stages=0: expected an integer >= 1"),
        (5, "parameters", r"num_stages=5 is more than the 4 blocks"),
        (2, "balanced", r"unknown partition method 'balanced'"),
        (3, [2, 2], r"block counts \[2, 2\] name 2 stages, but num_stages=3"),
        (2, [0, 4], r"block counts \[0, 4\]: every stage needs at least 1 block"),
        (2, [2, 3], r"block counts \[2, 3\] sum to 5, but GPT2LMHeadModel has 4 blocks"),
        (2, [2.0, 2], r"list of ints"),
    ],
)
def test_bad_methods_and_counts(num_stages, method, message):
    with pytest.raises(ValueError, match=message):
        partition(make_model("gpt2_lm"), num_stages, method)


# ---------------------------------------------------------------------------------------------- ties + merge
def sum_tied_grads(stages) -> None:
    for key, tie in tie_groups(stages).items():
        total = sum(stages[i].tied_parameters()[key].grad for i in tie.holders)
        for i in tie.holders:
            stages[i].tied_parameters()[key].grad = total.clone()


@pytest.mark.parametrize("kind", ["gpt2_lm", "deberta_v2"])
def test_tied_copies_stay_identical_and_merge_round_trips(kind, tmp_path):
    model = make_model(kind)
    stages = partition(model, 3)
    groups = tie_groups(stages)
    assert groups
    for key, tie in groups.items():
        assert all(torch.equal(stages[i].tied_parameters()[key], stages[tie.holders[0]].tied_parameters()[key])
                   for i in tie.holders)
    opts = [torch.optim.SGD(s.parameters(), lr=0.5) for s in stages]
    ref_opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(3):
        batch = make_batch(kind, seed=10 + step)
        for opt in (*opts, ref_opt):
            opt.zero_grad(set_to_none=True)
        run(stages, batch).loss.backward()
        sum_tied_grads(stages)
        for opt in opts:
            opt.step()
        model(**batch).loss.backward()
        ref_opt.step()
    for key, tie in groups.items():
        first = stages[tie.holders[0]].tied_parameters()[key]
        assert not torch.equal(first, dict(make_model(kind).named_parameters())[key])  # it did train
        for i in tie.holders[1:]:
            assert torch.equal(stages[i].tied_parameters()[key], first), f"{key}: copy on stage {i} diverged"

    batch = make_batch(kind, seed=99)
    with torch.no_grad():
        pipe_loss = run(stages, batch).loss.item()
        ref_loss = model(**batch).loss.item()
    assert abs(pipe_loss - ref_loss) <= 1e-4 * abs(ref_loss), (pipe_loss, ref_loss)

    merged = merge_into(MODEL_CLASSES[kind](model.config), [s.hf_state_dict() for s in stages])
    merged.save_pretrained(tmp_path)
    reloaded = MODEL_CLASSES[kind].from_pretrained(tmp_path)
    with torch.no_grad():
        reloaded_loss = reloaded(**batch).loss.item()
    assert abs(reloaded_loss - pipe_loss) <= 1e-6 * abs(pipe_loss), (reloaded_loss, pipe_loss)
    if kind == "gpt2_lm":
        assert reloaded.lm_head.weight.data_ptr() == reloaded.transformer.wte.weight.data_ptr()


def test_merge_into_rejects_missing_diverged_and_unknown():
    model = make_model("gpt2_lm")
    stages = partition(model, 3)
    dicts = [s.hf_state_dict() for s in stages]
    fresh = lambda: GPT2LMHeadModel(model.config)  # noqa: E731
    missing = r"no stage provides 24 weights of GPT2LMHeadModel \(under transformer\.h\.1, transformer\.h\.2;"
    with pytest.raises(ValueError, match=missing):
        merge_into(fresh(), [dicts[0], dicts[2]])
    bad = dict(dicts[2], **{"lm_head.weight": dicts[2]["lm_head.weight"] + 1e-3})
    with pytest.raises(ValueError, match=r"tied weights 'transformer\.wte\.weight' \(stage 0\) and 'lm_head\.weight'"):
        merge_into(fresh(), [dicts[0], dicts[1], bad])
    with pytest.raises(ValueError, match=r"stage 1 has key 'transformer\.h\.99\.ln_1\.weight'"):
        merge_into(fresh(), [dicts[0], {"transformer.h.99.ln_1.weight": torch.zeros(64)}, dicts[2]])
    deb = partition(make_model("deberta"), 2)
    d0, d1 = deb[0].hf_state_dict(), deb[1].hf_state_dict()
    d1["deberta.encoder.rel_embeddings.weight"] = d1["deberta.encoder.rel_embeddings.weight"] * 2
    with pytest.raises(ValueError, match=r"copies of 'deberta\.encoder\.rel_embeddings\.weight' in stages 0 and 1"):
        merge_into(DebertaForSequenceClassification(config("deberta")), [d0, d1])
    # and the untouched dicts merge to the original weights
    merged = merge_into(fresh(), dicts)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in merged.state_dict().items())


# ---------------------------------------------------------------------------------------------- checkpointing
@pytest.mark.parametrize("kind", KINDS)
def test_activation_checkpointing_same_loss_and_grads(kind, monkeypatch):
    model = make_model(kind)
    plain = partition(model, 2)
    ckpt = partition(model, 2, activation_checkpointing=True)
    calls = []
    real = torch.utils.checkpoint.checkpoint

    def counting(*args, **kwargs):
        calls.append(kwargs.get("use_reentrant"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", counting)
    batch = make_batch(kind)
    a = run(plain, batch)
    assert calls == []
    b = run(ckpt, batch)
    assert calls == [False] * 4  # one per block, non-reentrant
    a.loss.backward()
    b.loss.backward()
    assert a.loss.item() == b.loss.item()
    for sp, sc in zip(plain, ckpt):
        for (name, p), (_, q) in zip(sp.named_parameters(), sc.named_parameters()):
            assert_close_rel(q.grad, p.grad, 1e-6, name)
    calls.clear()
    for s in ckpt:
        s.eval()
    with torch.no_grad():
        run(ckpt, batch)
    assert calls == []
