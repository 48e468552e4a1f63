"""Resharding a checkpoint onto another shape (aqpipe/reshape.py), against the unpartitioned model: every weight and
its optimizer state lands where the new stage holds it (a tied copy from its owner, not the follower's stale copy);
each new stage reads only the old stages holding what it needs; a boundary's codecs carry only where both shapes cut
at the same block, and from the old stage on the same side."""
import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from aqpipe import reshape
from aqpipe.pipeline import owned_parameters
from aqpipe.pipeline.partitioning import partition, tie_groups

CONFIG = LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
                     num_key_value_heads=1, tie_word_embeddings=True)
SIDES = ("prev.forward", "prev.backward", "next.forward", "next.backward")


def _step(params):
    """One AdamW step with each parameter's gradient its own value: every weight and moment differs by name."""
    opt = torch.optim.AdamW(params, lr=0.1)
    for p in params:
        p.grad = p.detach().clone() + 1.0
    opt.step()
    return opt


def _codecs(stage, stages):
    return {name: {"from": (stage, name)} for name in SIDES
            if (name.startswith("prev") and stage > 0) or (name.startswith("next") and stage < stages - 1)}


def _engine_states(model, counts, trained):
    """Each stage's engine state (as PipelineEngine.state_dict holds it) of `model` split by `counts`; `trained`: after
    one step of each stage's optimizer (followers of a tie are not stepped: their copies go stale)."""
    stages = partition(model, len(counts), list(counts))
    ties = tie_groups(stages)
    out = {}
    for s, stage in enumerate(stages):
        owned = owned_parameters(stage, ties)
        opt = _step(owned) if trained else torch.optim.AdamW(owned, lr=0.1)
        ids = {id(p) for p in owned}
        out[s] = {"place": {"stage": s}, "model": {k: v.clone() for k, v in stage.state_dict().items()},
                  "optimizer": opt.state_dict(), "lr_scheduler": {"step": 7} if trained else None,
                  "global_step": 7 if trained else 0, "skipped_steps": 1 if trained else 0,
                  "codecs": _codecs(s, len(counts)), "data_parallel": None, "auto_bits": None,
                  "blocks": list(stage.block_indices),
                  "optimized": [n for n, p in stage.named_parameters() if id(p) in ids],
                  "tied_names": {k: v for k, v in stage.hf_parameter_names().items() if k != v}}
    return out, stages


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(CONFIG)


@pytest.mark.parametrize("old_counts,new_counts", [([1, 1, 1, 1], [2, 2]), ([2, 2], [1, 1, 1, 1]),
                                                   ([1, 3], [3, 1]), ([2, 2], [4])])
def test_each_weight_and_its_moments_land_where_the_new_stage_holds_them(model, old_counts, new_counts):
    reference = copy.deepcopy(model)
    ref_opt = _step(list(reference.parameters()))
    names = [n for n, _ in reference.named_parameters()]
    ref_moments = {n: ref_opt.state[p]["exp_avg"] for n, p in zip(names, reference.parameters())}
    old_shape, new_shape = reshape.Shape.from_counts(old_counts), reshape.Shape.from_counts(new_counts)
    records, _ = _engine_states(copy.deepcopy(model), old_counts, trained=True)
    templates, new_stages = _engine_states(copy.deepcopy(model), new_counts, trained=False)
    ties = tie_groups(new_stages)
    for s, stage in enumerate(new_stages):
        holds = any(s in tie.holders for tie in ties.values())
        read = {k: records[k] for k in reshape.sources(old_shape, new_shape, s, holds)}
        state, fresh = reshape.merge(read, templates[s], old_shape, new_shape, s, stage.hf_parameter_names())
        origin = stage.hf_parameter_names()
        for name, value in state["model"].items():  # a tied copy holds its owner's stepped weight
            assert torch.equal(value, reference.state_dict()[origin.get(name, name)]), name
        assert len(state["optimizer"]["state"]) == len(templates[s]["optimized"]) > 0
        for i, name in enumerate(templates[s]["optimized"]):
            assert torch.equal(state["optimizer"]["state"][i]["exp_avg"], ref_moments[origin.get(name, name)]), name
        assert state["global_step"] == 7 and state["lr_scheduler"] == {"step": 7} and state["skipped_steps"] == 1
        assert {"data_parallel", "auto_bits"} <= fresh
        stage.load_state_dict(state["model"])  # the new stage takes it whole
        reopt = torch.optim.AdamW(owned_parameters(stage, ties), lr=0.1)
        reopt.load_state_dict(state["optimizer"])


def test_a_new_stage_reads_only_the_old_stages_holding_its_weights():
    four, two = reshape.Shape.from_counts([1, 1, 1, 1]), reshape.Shape.from_counts([2, 2])
    assert reshape.sources(four, two, 0, holds_tie=True) == [0, 1, 3]  # the tied weight's owner, the head's stage
    assert reshape.sources(four, two, 0, holds_tie=False) == [0, 1]
    assert reshape.sources(four, two, 1, holds_tie=True) == [0, 2, 3]
    assert reshape.sources(four, two, 1, holds_tie=False) == [2, 3]
    assert reshape.sources(two, four, 1, holds_tie=False) == [0]
    assert reshape.sources(two, four, 2, holds_tie=False) == [1]
    assert reshape.sources(two, four, 3, holds_tie=True) == [0, 1]


def test_a_boundarys_codecs_carry_only_at_a_cut_both_shapes_have():
    old, new = reshape.Shape.from_counts([1, 1, 2]), reshape.Shape.from_counts([2, 2])  # cuts 1, 2 -> 2
    assert reshape.carried_boundaries(old, new, 0) == {"next": 1}  # its side of the cut before block 2: old stage 1
    assert reshape.carried_boundaries(old, new, 1) == {"prev": 2}
    moved = reshape.Shape.from_counts([3, 1])  # cut 3: no old stage cut there
    assert reshape.carried_boundaries(old, moved, 0) == {} and reshape.carried_boundaries(old, moved, 1) == {}


def test_codecs_carry_from_the_old_stage_on_the_same_side(model):
    records, _ = _engine_states(copy.deepcopy(model), [1, 1, 2], trained=True)
    templates, stages = _engine_states(copy.deepcopy(model), [2, 2], trained=False)
    old, new = reshape.Shape.from_counts([1, 1, 2]), reshape.Shape.from_counts([2, 2])
    first, fresh = reshape.merge({0: records[0], 1: records[1]}, templates[0], old, new, 0,
                                 stages[0].hf_parameter_names())
    assert first["codecs"] == {"next.forward": {"from": (1, "next.forward")},
                               "next.backward": {"from": (1, "next.backward")}}
    last, _ = reshape.merge({0: records[0], 2: records[2]}, templates[1], old, new, 1, stages[1].hf_parameter_names())
    assert last["codecs"] == {"prev.forward": {"from": (2, "prev.forward")},
                              "prev.backward": {"from": (2, "prev.backward")}}
    moved = reshape.Shape.from_counts([3, 1])
    templates, stages = _engine_states(copy.deepcopy(model), [3, 1], trained=False)
    _, fresh = reshape.merge({0: records[0], 1: records[1], 2: records[2]}, templates[0], old, moved, 0,
                             stages[0].hf_parameter_names())
    assert {"next.forward", "next.backward"} <= fresh


def test_another_replica_count_reads_every_old_replica_and_keeps_no_codec(model):
    """The same stages on 1 replica from 2: the rank reads both replicas' files of its stage; no boundary keeps its
    codecs (their rows were the old replicas' shards'), where the same shape on the same count keeps them all."""
    saved = {"stage_blocks": [2, 2], "fingerprint": {"data_parallel.replicas": 2},
             "position": {"epoch": 1, "index": 3, "dealt": [2, 4]}}
    assert reshape.reading(saved, [2, 2], 1, lambda: False, replicas=2) is None
    regrouped = reshape.reading(saved, [2, 2], 1, lambda: False, replicas=1)
    assert (regrouped.sources, regrouped.replicas, regrouped.regroups) == ([1], 2, True)
    assert [regrouped.own(r) for r in range(3)] == [0, 1, 1]  # a new replica past the old ones takes the last's
    records, _ = _engine_states(copy.deepcopy(model), [2, 2], trained=True)
    templates, stages = _engine_states(copy.deepcopy(model), [2, 2], trained=False)
    shape = reshape.Shape.from_counts([2, 2])
    kept, _ = reshape.merge({0: records[0], 1: records[1]}, templates[0], shape, shape, 0,
                            stages[0].hf_parameter_names())
    assert set(kept["codecs"]) == {"next.forward", "next.backward"}
    none, fresh = reshape.merge({0: records[0], 1: records[1]}, templates[0], shape, shape, 0,
                                stages[0].hf_parameter_names(), codecs=False)
    assert none["codecs"] == {} and {"next.forward", "next.backward"} <= fresh


def test_a_checkpoint_that_does_not_say_its_shape_resumes_only_on_its_stage_count():
    manifest = {"fingerprint": {"distributed.pipeline_stages": 4}}
    assert reshape.reading(manifest, [1, 1, 1, 1], 0, lambda: False) is None
    with pytest.raises(ValueError, match="written before checkpoints recorded their blocks per stage; expected "
                                         "pipeline_stages=4"):
        reshape.reading(manifest, [2, 2], 0, lambda: False)
    saved = {"stage_blocks": [1, 1, 1, 1], "fingerprint": {}}
    assert reshape.reading(saved, [1, 1, 1, 1], 2, lambda: False) is None
    assert reshape.reading(saved, [2, 2], 1, lambda: False) == reshape.Reading(reshape.Shape.from_counts([1, 1, 1, 1]),
                                                                        reshape.Shape.from_counts([2, 2]), [2, 3])


def test_a_state_from_before_the_parameters_order_was_recorded_is_refused_in_one_line(model):
    records, _ = _engine_states(copy.deepcopy(model), [2, 2], trained=True)
    templates, stages = _engine_states(copy.deepcopy(model), [4], trained=False)
    del records[1]["optimized"]
    with pytest.raises(ValueError, match="stage 1 was written by an aqpipe that did not record its parameters' order"):
        reshape.merge(records, templates[0], reshape.Shape.from_counts([2, 2]), reshape.Shape.from_counts([4]), 0,
                      stages[0].hf_parameter_names())


def test_a_codec_is_never_carried_to_another_cut_even_if_the_recorded_shape_says_so(model):
    """A manifest whose blocks per stage disagree with its stages' own files (the old stage 1 held blocks 1..2, the
    manifest says block 1): the carried codec's cut is checked against the old stage's own blocks."""
    records, _ = _engine_states(copy.deepcopy(model), [1, 2, 1], trained=True)
    templates, stages = _engine_states(copy.deepcopy(model), [2, 2], trained=False)
    lying = reshape.Shape.from_counts([1, 1, 2])  # cuts 1 and 2: says the cut before block 2 is shared
    with pytest.raises(ValueError, match="codec next.forward of the boundary before block 3 would be reused at the "
                                         "one before block 2"):
        reshape.merge({0: records[0], 1: records[1]}, templates[0], lying, reshape.Shape.from_counts([2, 2]), 0,
                      stages[0].hf_parameter_names())


def test_replicas_become_their_average_and_equal_ones_stay_to_the_bit(model):
    one, _ = _engine_states(copy.deepcopy(model), [2, 2], trained=True)
    other = copy.deepcopy(one)
    for record in other.values():
        record["model"] = {k: v + 1.0 for k, v in record["model"].items()}
        record["codecs"] = {k: {"from": "replica 1"} for k in record["codecs"]}
    equal = reshape.averaged([one[0], copy.deepcopy(one[0])], 1)
    assert all(torch.equal(equal["model"][k], v) for k, v in one[0]["model"].items())
    mixed = reshape.averaged([one[1], other[1]], 1)
    for name, value in one[1]["model"].items():
        assert torch.allclose(mixed["model"][name], value + 0.5), name
    assert mixed["codecs"] == other[1]["codecs"]  # a replica's codecs (its rows, its streams) stay its own
    moments = [r["optimizer"]["state"][0]["exp_avg"] for r in (one[1], other[1])]
    assert torch.equal(mixed["optimizer"]["state"][0]["exp_avg"], moments[0])  # equal moments: kept as they were


def test_a_low_precision_decentralized_algorithm_restarts_from_the_weights_it_is_given():
    """After a reshaped resume loads the averaged weights, every copy of a neighbour's model is those weights (built
    before the load, they held the weights the stage was built with)."""
    from types import SimpleNamespace

    from aqpipe.data_parallel.decentralized import LowPrecisionDecentralizedSGD
    from aqpipe.data_parallel.flat import flatten

    params = [torch.nn.Parameter(torch.zeros(4))]
    algo = LowPrecisionDecentralizedSGD(params, SimpleNamespace(rank=0, size=2), bits=8)
    with torch.no_grad():
        params[0].add_(3.0)
    algo.restart(5)
    assert algo.step_count == 5
    assert algo.replicas and all(torch.equal(x, flatten(params, torch.float32)) for x in algo.replicas.values())
