"""Which number a vLLM worker rank loads under, and how many must load.

vLLM lays an engine's ranks out as PP x PCP x TP (`parallel_state`): within
a pipeline stage, prefill context parallel rank p and tensor parallel rank
t are rank `p * tp + t` of `tp * pcp`. The encoder, and with it the EC
connector's loads, runs on pipeline stage 0 only, where every one of those
ranks loads each hit (they hold identical encoder outputs). So a worker
attaches as that rank of that world, and the scheduler answers hits only
once all `tp * pcp` of them mapped the region: counting the tensor parallel
rank alone made TP=8 x PCP=2 look complete with 8 ranks, while the PCP ranks
on another node could load nothing. Ranks of later stages attach too (vLLM
builds a connector in every worker), with the engine's token like every
worker (derived at Attach, `ec_client.engine_token`), and under the number
of their own tp/pcp position, which is their stage-0 peer's: the daemon
counts distinct numbers per engine instance, so on a host where the stage-0
ranks map the region they add nothing. (Where a stage-0 rank is on another
host and its later-stage peer on this one, that peer's number counts as
mapped here although the rank that loads under it never maps this region.)
"""

from __future__ import annotations

from typing import NamedTuple


class LoadingRank(NamedTuple):
    rank: int  # pcp_rank * tp_size + tp_rank
    world_size: int  # tp_size * pcp_size


def loading_world(tp_size: int, pcp_size: int = 1) -> int:
    """How many worker ranks load each hit (and must map the region)."""
    if tp_size < 1 or pcp_size < 1:
        raise ValueError(f"parallel sizes must be positive (tp={tp_size}, pcp={pcp_size})")
    return tp_size * pcp_size


def loading_rank(tp_rank: int, tp_size: int, pcp_rank: int = 0,
                 pcp_size: int = 1) -> LoadingRank:
    """The rank a worker attaches as, among its engine's loading ranks."""
    world = loading_world(tp_size, pcp_size)
    if not (0 <= tp_rank < tp_size and 0 <= pcp_rank < pcp_size):
        raise ValueError(f"rank out of range: tp {tp_rank} of {tp_size}, "
                         f"pcp {pcp_rank} of {pcp_size}")
    return LoadingRank(pcp_rank * tp_size + tp_rank, world)
