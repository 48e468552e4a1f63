"""pipeline.ties: who owns a tie, and which rows a follower reads first and last in each micro-batch."""
import pytest
import torch

from aqpipe.pipeline import Tie


def test_the_owner_is_the_last_holder_using_every_row():
    gpt2 = Tie((0, 3), {0: ("input_ids",)})
    assert (gpt2.owner, gpt2.followers) == (3, (0,))
    deberta = Tie((0, 1, 2))
    assert (deberta.owner, deberta.followers) == (2, (0, 1))
    with pytest.raises(ValueError, match="two or more distinct stages"):
        Tie((1,))
    with pytest.raises(ValueError, match="outside the holders"):
        Tie((0, 1), {2: ("input_ids",)})


def test_a_lookup_follower_gets_each_row_before_its_first_read_and_returns_it_after_its_last():
    mbs = [{"input_ids": torch.tensor([[5, 1, 5]])}, {"input_ids": torch.tensor([[7, 1]])},
           {"input_ids": torch.tensor([[2, 9]]), "token_type_ids": torch.tensor([[5, 0]])}]
    step = Tie((0, 2), {0: ("input_ids", "token_type_ids")}).rows(0, mbs, num_rows=10)
    assert step.every.tolist() == [0, 1, 2, 5, 7, 9]
    assert [r.tolist() for r in step.first] == [[1, 5], [7], [0, 2, 9]]  # sent before that micro-batch's forward
    assert [r.tolist() for r in step.last] == [[], [1, 7], [0, 2, 5, 9]]  # sent after that micro-batch's backward
    for chunks in (step.first, step.last):  # each row exactly once: the bytes equal one message of every row
        assert sorted(torch.cat(chunks).tolist()) == step.every.tolist()


def test_a_follower_using_every_row_gets_them_all_first_and_returns_them_all_last():
    mbs = [{"input_ids": torch.zeros(1, 2, dtype=torch.long)}] * 3
    step = Tie((0, 1)).rows(0, mbs, num_rows=4)
    assert step.every.tolist() == [0, 1, 2, 3]
    assert [r.tolist() for r in step.first] == [[0, 1, 2, 3], [], []]
    assert [r.tolist() for r in step.last] == [[], [], [0, 1, 2, 3]]
