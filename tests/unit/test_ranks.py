"""The rank a vLLM worker attaches as, and how many ranks must map the region
before its engine answers hits: every tensor x prefill context parallel rank
of pipeline stage 0, numbered as vLLM lays them out (pcp_rank * tp + tp_rank)."""

from __future__ import annotations

import pytest

from ec_client.ranks import LoadingRank, loading_rank, loading_world


def test_tp8_x_pcp2_is_sixteen_distinct_ranks_of_a_world_of_sixteen():
    ranks = [loading_rank(t, 8, p, 2) for p in range(2) for t in range(8)]
    assert {r.world_size for r in ranks} == {16} == {loading_world(8, 2)}
    assert sorted(r.rank for r in ranks) == list(range(16))  # none repeats another


@pytest.mark.parametrize("tp_rank, tp, pcp_rank, pcp, expected", [
    (0, 1, 0, 1, LoadingRank(0, 1)),
    (3, 4, 0, 1, LoadingRank(3, 4)),  # TP alone: the tensor parallel rank
    (1, 2, 1, 2, LoadingRank(3, 4)),  # vLLM's PP x PCP x TP layout within a stage
    (0, 1, 2, 3, LoadingRank(2, 3)),  # PCP alone
])
def test_the_loading_rank_follows_vllms_layout(tp_rank, tp, pcp_rank, pcp, expected):
    assert loading_rank(tp_rank, tp, pcp_rank, pcp) == expected


@pytest.mark.parametrize("args", [(2, 2, 0, 1), (0, 2, 2, 2), (-1, 2, 0, 1), (0, 0, 0, 1),
                                  (0, 1, 0, 0)])
def test_a_rank_outside_its_world_is_refused(args):
    with pytest.raises(ValueError):
        loading_rank(*args)
