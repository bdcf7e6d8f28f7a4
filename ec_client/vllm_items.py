"""What the scheduler side of `ECDaemonConnector` knows of vLLM's own items.

Three facts the daemon cannot tell it, kept on vLLM's scheduling thread:

- Which items vLLM's encoder cache holds: allocated (`update_state_after_alloc`)
  until vLLM's scheduler reports them freed (`free_encoder_mm_hashes`, the
  same list that makes the workers drop them). Such an item needs no transfer,
  so `ensure_cache_available` never asks the daemon about it nor defers for it.
- Which items arrived metadata-only: announced by a producer in the request's
  `ec_transfer_params` and carrying no media of their own (vLLM's
  token-in-token-out serving accepts such items only with those params). This
  engine cannot encode them, so they are loaded from the daemon or the request
  fails cleanly (`take_unavailable_requests`): after `max_defer_seconds`
  without the item in the cache, or at once when its load failed.
- What a producer reports when a request finishes: vLLM's per-item
  `ec_transfer_params` (`collect_ec_item_metadata`), so a consumer can skip
  media preprocessing. Nothing of ec-daemon's goes inside `metadata`; an item
  this engine cannot have saved (a LoRA adapter's, or the daemon is out of
  reach) reports empty metadata, as vLLM's CPU connector does for an absent
  entry, so an orchestrator keeps its media on the request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.ec_transfer.ec_connector.utils import (
    PlaceholderMetadataResolver,
    collect_ec_item_metadata,
)

from ec_client.scheduler_side.staging import Stage

if TYPE_CHECKING:
    from vllm.config import ModelConfig
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class RequestItems:
    def __init__(self, model_config: ModelConfig, max_defer_seconds: float) -> None:
        self.max_defer_seconds = max_defer_seconds
        self._model_config = model_config
        self._resolver: PlaceholderMetadataResolver | None = None  # built on first use
        self._held: set[str] = set()
        self._fetch_since: dict[tuple[str, str], float] = {}  # (request, mm_hash) -> first ask
        self._unobtainable: set[str] = set()

    @property
    def resolver(self) -> PlaceholderMetadataResolver:
        """vLLM's resolver of the placeholder fields each modality needs
        published (it builds the model's processor once: not at start-up)."""
        if self._resolver is None:
            self._resolver = PlaceholderMetadataResolver(self._model_config)
        return self._resolver

    # ------------------------------------------------- vLLM's encoder cache

    def allocated(self, mm_hash: str) -> None:
        self._held.add(mm_hash)

    def freed(self, mm_hashes: Iterable[str]) -> None:
        self._held.difference_update(mm_hashes)

    def held(self, mm_hash: str) -> bool:
        """Does vLLM's encoder cache hold `mm_hash` (computed or loaded)?"""
        return mm_hash in self._held

    # ------------------------------------------------- metadata-only items

    def metadata_only(self, request: Request, feature: MultiModalFeatureSpec) -> bool:
        """Was this item announced by a producer and sent without media?"""
        announced = (request.ec_transfer_params or {}).get(feature.identifier)
        if not isinstance(announced, dict):  # the request's own input: not trusted as ours
            return False
        data = feature.data
        if data is None:
            return True
        metadata = self.resolver.fields_for(feature.modality)
        return not any(element.data is not None for key, element in data.items()
                       if key not in metadata)

    def fetched(self, request_id: str, mm_hashes: list[str],
                stage: Callable[[str], Stage]) -> bool:
        """May the request go ahead as far as these metadata-only items go?
        Each must be staged (`stage`: the item's load, planned now if the
        cache has it). One still staging defers the request; one the cache
        lacks defers it for `max_defer_seconds` at most; then, or at once
        when its load failed, the request is failed (`take_unavailable`),
        since this engine has no media to encode it from."""
        states = {mm_hash: stage(mm_hash) for mm_hash in mm_hashes}
        for mm_hash, state in states.items():
            if state is not Stage.ABSENT:
                self._fetch_since.pop((request_id, mm_hash), None)
            if state is Stage.FAILED and request_id not in self._unobtainable:
                log.error("ec-daemon: request %s needs %s, which came without media, and its "
                          "load from the cache failed: failing the request", request_id,
                          mm_hash)
                self._unobtainable.add(request_id)
        missing = [h for h, state in states.items() if state is Stage.ABSENT]
        if not missing:
            return all(state is Stage.STAGED for state in states.values())
        now = time.monotonic()
        for mm_hash in missing:
            since = self._fetch_since.setdefault((request_id, mm_hash), now)
            if now - since >= self.max_defer_seconds and request_id not in self._unobtainable:
                log.error("ec-daemon: request %s needs %s, which came without media, and the "
                          "cache has not had it for %.1fs: failing the request", request_id,
                          mm_hash, now - since)
                self._unobtainable.add(request_id)
        return False

    def take_unavailable(self) -> set[str]:
        taken, self._unobtainable = self._unobtainable, set()
        return taken

    # ------------------------------------------------------ request ends

    def finished(self, request: Request) -> None:
        for feature in request.mm_features:
            self._fetch_since.pop((request.request_id, feature.identifier), None)
        self._unobtainable.discard(request.request_id)

    def transfer_params(self, request: Request,
                        saved: Callable[[str], bool]) -> dict[str, Any] | None:
        """A producer's `ec_transfer_params` for a finished request: vLLM's
        one entry per item, keyed by mm_hash; empty metadata for an item that
        was not `saved` to the cache."""
        items = collect_ec_item_metadata(request.mm_features, self.resolver)
        for mm_hash, item in items.items():
            if not saved(mm_hash):
                item["metadata"] = {}
        return items or None
