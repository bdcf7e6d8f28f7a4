"""What the connector's two halves hand each other each step, as vLLM's types.

The scheduler's half (`vllm_scheduler_role`) builds the step's metadata and
reads the workers' reports; the worker's half (`vllm_worker_role`) reads the
one and builds the other. Both import these from here, neither the other
half (as vLLM's CPU connector keeps what its halves share in `cpu/common.py`).
`ec_client.vllm_connector` gives both out under their old path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorMetadata,
    ECConnectorWorkerMetadata,
)

from ec_client.common.contract import StepMetadata
from ec_client.vllm_metrics import merge_stats


@dataclass
class ECDaemonConnectorMetadata(StepMetadata, ECConnectorMetadata):
    """Scheduler -> workers each step: `StepMetadata` (the loads, with
    extents, the regions they name by generation, the generations to keep
    mapped, the namespace) as vLLM's metadata type. The scheduler delegate
    builds it directly (`metadata_type`): no copy per step."""


@dataclass
class ECDaemonWorkerMetadata(ECConnectorWorkerMetadata):
    """Workers -> scheduler each step: one entry per rank and transfer staged
    (`done`) or not (`failed`: with what failed), the items whose save ended
    without an entry (`dropped`: the scheduler's producer announces no
    metadata for them), and the worker's counters (vLLM aggregates over the
    ranks)."""

    done: list[int] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    failed: list[tuple[int, str]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        assert isinstance(other, ECDaemonWorkerMetadata)
        self.done.extend(other.done)
        self.failed.extend(other.failed)
        self.dropped.extend(other.dropped)
        self.stats = merge_stats(self.stats, other.stats)
        return self
