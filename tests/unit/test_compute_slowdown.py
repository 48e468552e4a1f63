"""AQPIPE_COMPUTE_SLOWDOWN (an emulated slower device): one factor per rank, or one for every rank of a world whose
size changes (an elastic launch); anything else named in one line."""
import pytest

from aqpipe.environment import compute_slowdown


def test_a_factor_per_rank_or_one_for_all():
    assert [compute_slowdown(r, 3, {"AQPIPE_COMPUTE_SLOWDOWN": "1,2.5,4"}) for r in range(3)] == [1.0, 2.5, 4.0]
    for world in (2, 4):  # the same setting before and after the world shrinks
        assert [compute_slowdown(r, world, {"AQPIPE_COMPUTE_SLOWDOWN": "20"}) for r in range(world)] == [20.0] * world
    assert compute_slowdown(0, 2, {}) == 1.0


@pytest.mark.parametrize("raw", ["1,2", "0.5", "2,inf,1"])
def test_a_bad_setting_is_one_line(raw):
    with pytest.raises(ValueError, match=f"AQPIPE_COMPUTE_SLOWDOWN='{raw}': expected 3 factors >= 1, one per rank, "
                                         "comma-separated, or one for every rank"):
        compute_slowdown(0, 3, {"AQPIPE_COMPUTE_SLOWDOWN": raw})
