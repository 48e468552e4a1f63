"""The subspace codec's measurements: a boundary's spectrum on a model as users have one, and an export scored
without the pipeline."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks import boundary_spectrum, export_score
from tests.helpers.files import tiny_llama_dir


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("spectrum")
    corpus = path / "corpus.txt"
    corpus.write_text(" ".join(f"line {i} of a corpus the model reads, with words {i * 7 % 13}." for i in range(2000)))
    return tiny_llama_dir(path / "llama"), corpus


def test_the_spectrum_keeps_all_energy_at_full_rank_and_more_than_its_share_in_the_top_direction(llama, tmp_path):
    model, corpus = llama
    out = tmp_path / "spectrum.json"
    assert boundary_spectrum.main([str(model), str(corpus), "--fit", "4", "--held_out", "4", "--seq_len", "32",
                                   "--tuned", str(model), "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert sorted(result) == ["embedding", "initialisation", "pretrained", "tied_change"]
    assert result["tied_change"]["relative_change"] == 0.0  # the model against itself changed nothing
    for block in (result[k] for k in ("pretrained", "initialisation", "embedding")):
        ranks = block["ranks"]
        assert [r["k"] for r in ranks] == [1, 2, 4, 8, 16, 32, 64] and block["width"] == 64
        energy = [r["activation"] for r in ranks]
        assert energy == sorted(energy) and energy[-1] == pytest.approx(1.0)  # a basis of the whole width
        assert ranks[-1]["gradient_in_activation_basis"] == pytest.approx(1.0)
        assert energy[0] > 1 / 64  # the top direction holds more than an average one: largest first


def test_an_export_is_scored_as_transformers_computes_its_loss(llama, tmp_path, capsys):
    model, corpus = llama
    loss = export_score.score(str(model), str(corpus), 32, 4)
    from transformers import AutoTokenizer

    from aqpipe.data.lm import lm_dataset

    blocks = lm_dataset(str(corpus), AutoTokenizer.from_pretrained(model), 32, split="eval").limited(4)
    ids = torch.stack([torch.as_tensor(blocks[i]["input_ids"]) for i in range(len(blocks))])
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        per_sample = [float(hf(input_ids=row[None], labels=row[None]).loss) for row in ids]
    assert len(per_sample) == 4 and loss == pytest.approx(sum(per_sample) / 4, rel=1e-5)
    assert export_score.main(["--dataset", str(corpus), str(tmp_path / "none")]) == 2
    assert "no exported model (config.json) or adapter (adapter_config.json) in" in capsys.readouterr().err
