"""A micro-batch staged for its stage (pipeline/micro_batch.py): the causal mask built from facts the host read gives
transformers' own mask, to the element, for every form a batch takes (plain, padded, packed, an all-ones mask, position
ids that do not restart, position ids that jump forward), both attention implementations that build one (sdpa, eager)
and both kinds (full, sliding window); and built so, it reads no device value back (a host sync per call and stage on
a GPU), where transformers' own decision reads one each time."""
import pytest
import torch
from transformers import MistralConfig

from aqpipe.pipeline.micro_batch import MaskFacts, StagedBatch, mask_facts, staged
from aqpipe.pipeline.stages import heads
from aqpipe.pipeline.stages.heads import causal_mask, position_ids
from tests.helpers.host_reads import HostReads

B, T = 3, 12


def batches() -> dict[str, dict[str, torch.Tensor]]:
    ids = torch.arange(B * T).view(B, T) % 50
    padding = torch.ones(B, T, dtype=torch.long)
    padding[1, 9:] = 0
    padding[2, 4:] = 0
    return {
        "plain": {"input_ids": ids},
        "padded": {"input_ids": ids, "attention_mask": padding},
        "all ones": {"input_ids": ids, "attention_mask": torch.ones(B, T, dtype=torch.long)},
        "packed": {"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4],
                                                                   [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
                                                                   [0, 1, 0, 1, 0, 1, 2, 3, 4, 5, 0, 1]])},
        "positions from 0": {"input_ids": ids, "position_ids": torch.arange(T).expand(B, T)},
        # a jump forward starts a new sequence for transformers as a restart does
        "positions that jump": {"input_ids": ids, "position_ids": torch.tensor([
            [0, 1, 2, 3, 7, 8, 9, 10, 11, 12, 13, 14], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
            [0, 1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22]])},
    }


def config(attention: str) -> MistralConfig:
    cfg = MistralConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=1,
                        vocab_size=50, intermediate_size=32, sliding_window=5)
    cfg._attn_implementation = attention
    return cfg


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["full_attention", "sliding_attention"])
@pytest.mark.parametrize("name", list(batches()))
def test_the_mask_from_host_facts_is_transformers_own(name, kind, attention):
    batch, cfg = batches()[name], config(attention)
    hidden = torch.randn(B, T, 16)
    theirs = causal_mask(cfg, hidden, dict(batch), position_ids(hidden, batch), kind)  # a plain dict: HF decides
    stage_batch = staged([batch], "cpu")[0]
    ours = causal_mask(cfg, hidden, stage_batch, position_ids(hidden, stage_batch), kind)
    assert (ours is None) == (theirs is None)
    if theirs is not None:
        assert torch.equal(ours, theirs)


def test_the_facts_are_the_batches_forms():
    b = batches()
    assert mask_facts(b["plain"]) == MaskFacts(padded=False, packed=False)
    assert mask_facts(b["padded"]) == MaskFacts(padded=True, packed=False)
    assert mask_facts(b["all ones"]) == MaskFacts(padded=False, packed=False)
    assert mask_facts(b["packed"]) == MaskFacts(padded=False, packed=True)
    assert mask_facts(b["positions from 0"]) == MaskFacts(padded=False, packed=False)
    assert mask_facts(b["positions that jump"]) == MaskFacts(padded=False, packed=True)
    # transformers packs by position ids only where no attention mask is given: so do the facts
    assert not mask_facts({**b["packed"], "attention_mask": torch.ones(B, T)}).packed


@pytest.mark.parametrize("name", ["plain", "padded", "packed", "all ones"])
def test_a_staged_batch_builds_its_mask_reading_nothing_back(name):
    batch, cfg = batches()[name], config("sdpa")
    hidden = torch.randn(B, T, 16)
    stage_batch = staged([batch], "cpu")[0]  # the facts are read here, on the host's own tensors
    with HostReads() as told:
        for kind in ("full_attention", "sliding_attention"):
            causal_mask(cfg, hidden, stage_batch, position_ids(hidden, stage_batch), kind)
    assert told.reads == []
    with HostReads() as deciding:  # what a batch without facts costs: transformers reads its values
        causal_mask(cfg, hidden, dict(batch), position_ids(hidden, batch), "full_attention")
    assert deciding.reads


def test_staging_keeps_the_sample_ids_on_the_host_and_every_field():
    batch = {**batches()["padded"], "sample_id": torch.tensor([4, 7, 9]), "labels": torch.zeros(B, T)}
    out = staged([batch], "cpu")[0]
    assert isinstance(out, StagedBatch) and set(out) == set(batch)
    assert all(out[k] is batch[k] for k in batch)  # on the CPU nothing is copied
    assert out.facts.padded
    away = staged([batch], "meta")[0]  # another device (a GPU's stand-in): the compute's fields go, the ids stay
    assert away["sample_id"] is batch["sample_id"]
    assert {k for k in batch if away[k].device.type == "meta"} == set(batch) - {"sample_id"}
    assert away.facts.padded  # read on the host, before they left


def test_transformers_takes_the_facts():
    """The mask builders of the transformers the tests run take what the facts tell them: else every batch would
    go the syncing way and the tests above would still pass."""
    assert heads._TOLD
