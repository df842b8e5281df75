"""The test harness's own rule: a test that spawns gloo ranks must carry the multiproc marker, so that
scripts/test.sh runs it apart from the single-process tests."""
import pytest

from _dist import run_ranks


def _rank_id(rank, world_size):
    return rank


def test_unmarked_test_may_not_spawn_gloo_ranks():
    with pytest.raises(RuntimeError, match="mark it @pytest.mark.multiproc"):
        run_ranks(_rank_id, 2)


def test_unmarked_test_may_spawn_one_rank():
    assert run_ranks(_rank_id, 1, timeout=120) == [0]


@pytest.mark.multiproc
def test_marked_test_spawns_gloo_ranks():
    assert run_ranks(_rank_id, 2, timeout=120) == [0, 1]
