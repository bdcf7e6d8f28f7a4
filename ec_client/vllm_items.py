"""What the scheduler side of `ECDaemonConnector` knows of vLLM's own items.

Three facts the daemon cannot tell it, kept on vLLM's scheduling thread:

- Which items vLLM's encoder cache holds: allocated (`update_state_after_alloc`)
  until vLLM's scheduler reports them freed (`free_encoder_mm_hashes`, the
  same list that makes the workers drop them). Such an item needs no transfer,
  so `ensure_cache_available` never asks the daemon about it nor defers for it.
- Which items arrived metadata-only: announced by a producer in the request's
  `ec_transfer_params` and carrying no media of their own (vLLM's
  token-in-token-out serving accepts such items only with those params, and
  vLLM's E/PD proxy sends them so in its default rewrite mode). This engine
  cannot encode them, so they are loaded from the daemon or the request fails
  cleanly (`take_unavailable_requests`): at once when its load from the cache
  failed, or the daemon says nobody will make the item (the scheduler
  delegate's `unobtainable`: its save was dropped or refused, or its producer
  is gone), else after `max_defer_seconds`. Failed, not re-encoded: without the media there is
  nothing to encode, and vLLM's proxy retries a request PD fails with a 500
  (`--decode-retries`, 1 by default) by encoding it again, so failing at once
  costs the client the retry only, where waiting would add the whole bound.
- What a producer reports when a request finishes: vLLM's per-item
  `ec_transfer_params` (`collect_ec_item_metadata`), so a consumer can skip
  media preprocessing (`announced`). Nothing of ec-daemon's goes inside
  `metadata`; an item not known to be in the cache or on its way there
  reports empty metadata, as vLLM's CPU connector does for an absent entry,
  so an orchestrator keeps its media on the request (vLLM's proxy then sends
  PD the media, and PD encodes it). An item is announced when the cache
  holds it (the scheduler's view), or when this request encoded it (its save
  was queued) and its worker did not report the save dropped; never a LoRA
  adapter's item, nor any while the daemon is out of reach, nor one this
  request took from vLLM's encoder cache without encoding (no save was made
  for it now: a save dropped earlier stays dropped).
  Why announce an item whose save is still on its way: vLLM 0.32 hands the
  connector a finished request (`request_finished`) before the worker
  output of the step that finished it (`update_connector_output`), and an
  encoder instance's requests finish in the step that encodes them (its V1
  model runner does not even return an encoder-only step's worker output),
  so what its workers did with those saves is not known then. The daemon
  settles them for the consumer: the producer claimed each item before
  encoding it (`SchedulerDelegate.ensure`), so a consumer that asks
  (`unobtainable`) is told to wait while the save is on its way, and at once
  when it was dropped (the worker reports a dropped save to the daemon at
  once). The worker's own report (`saves_dropped`) reaches an engine whose
  runner returns it (`ec_both`), and spares a request that finishes after
  its encode step the announcement.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.ec_transfer.ec_connector.utils import (
    PlaceholderMetadataResolver,
    collect_ec_item_metadata,
)

from ec_client.common.limits import MAX_DROPPED_ITEMS
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
        self._encoded: dict[str, set[str]] = {}  # request -> items encoded for it here
        self._fetch_since: dict[tuple[str, str], float] = {}  # (request, mm_hash) -> first ask
        self._unobtainable: set[str] = set()
        self._dropped: OrderedDict[str, None] = OrderedDict()
        # Since the last take_stats.
        self._metadata_only = self._metadata_only_failures = 0

    @property
    def resolver(self) -> PlaceholderMetadataResolver:
        """vLLM's resolver of the placeholder fields each modality needs
        published (it builds the model's processor once: not at start-up)."""
        if self._resolver is None:
            self._resolver = PlaceholderMetadataResolver(self._model_config)
        return self._resolver

    # ------------------------------------------------- vLLM's encoder cache

    def allocated(self, mm_hash: str, request_id: str = "", encoded: bool = False) -> None:
        """vLLM allocated `mm_hash` in its encoder cache for `request_id`:
        loaded, or `encoded` here (a producer's save follows)."""
        self._held.add(mm_hash)
        if encoded:
            self._encoded.setdefault(request_id, set()).add(mm_hash)

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

    def fetched(self, request_id: str, mm_hashes: list[str], stage: Callable[[str], Stage],
                unobtainable: Callable[[list[str], str], list[str]]) -> bool:
        """May the request go ahead as far as these metadata-only items go?
        Each must be staged (`stage`: the item's load, planned now if the
        cache has it). One still staging, or not in the cache yet, defers
        the request; the request is failed (`take_unavailable`), since this
        engine has no media to encode it from, at once when an item's load
        failed or `unobtainable(missing, request_id)` names an item nobody
        will make, else after `max_defer_seconds`."""
        if request_id in self._unobtainable:
            return False
        now = time.monotonic()
        for mm_hash in mm_hashes:
            self._fetch_since.setdefault((request_id, mm_hash), now)
        states = {mm_hash: stage(mm_hash) for mm_hash in mm_hashes}
        failed = [h for h, state in states.items() if state is Stage.FAILED]
        if failed:
            self._fail(request_id, f"its load of {', '.join(failed)} from the cache failed")
            return False
        missing = [h for h, state in states.items() if state is Stage.ABSENT]
        if not missing:
            return all(state is Stage.STAGED for state in states.values())
        lost = unobtainable(missing, request_id)
        if lost:
            self._fail(request_id, f"nobody will make {', '.join(lost)} (its encoder "
                       "instance's save was dropped or refused, or that instance is gone)")
            return False
        waited = max(now - self._fetch_since[(request_id, h)] for h in missing)
        if waited >= self.max_defer_seconds:
            self._fail(request_id, f"the cache has not had {', '.join(missing)} for "
                       f"{waited:.1f}s (ec_daemon_max_defer_seconds)")
        return False

    def _fail(self, request_id: str, why: str) -> None:
        log.error("ec-daemon: request %s came without the media of an image it needs, and %s: "
                  "failing the request", request_id, why)
        self._unobtainable.add(request_id)
        self._metadata_only_failures += 1

    def saves_dropped(self, mm_hashes: Iterable[str]) -> None:
        """A worker reported these items' saves dropped (no entry made): not
        announced until the cache holds them."""
        dropped = self._dropped
        for mm_hash in mm_hashes:
            dropped[mm_hash] = None
            dropped.move_to_end(mm_hash)
        while len(dropped) > MAX_DROPPED_ITEMS:
            dropped.popitem(last=False)

    def take_stats(self) -> dict[str, int]:
        """Items of finished requests that came without media, and requests
        failed for one, since the last call."""
        stats = {"metadata_only_items": self._metadata_only,
                 "metadata_only_failures": self._metadata_only_failures}
        self._metadata_only = self._metadata_only_failures = 0
        return {k: v for k, v in stats.items() if v}

    def take_unavailable(self) -> set[str]:
        taken, self._unobtainable = self._unobtainable, set()
        return taken

    # ------------------------------------------------------ request ends

    def finished(self, request: Request) -> None:
        for feature in request.mm_features:
            self._fetch_since.pop((request.request_id, feature.identifier), None)
            if self.metadata_only(request, feature):  # (counted once, loaded or not)
                self._metadata_only += 1
        self._unobtainable.discard(request.request_id)
        self._encoded.pop(request.request_id, None)

    def announced(self, request_id: str, mm_hash: str, cached: Callable[[str], bool]) -> bool:
        """Does a producer announce `mm_hash` for `request_id` (see the
        module's docstring)? `cached(mm_hash)`: the cache holds it."""
        if cached(mm_hash):
            return True
        return mm_hash in self._encoded.get(request_id, ()) and mm_hash not in self._dropped

    def transfer_params(self, request: Request,
                        announce: Callable[[str], bool]) -> dict[str, Any] | None:
        """A producer's `ec_transfer_params` for a finished request: vLLM's
        one entry per item, keyed by mm_hash; empty metadata for an item not
        to `announce` (call before `finished`)."""
        items = collect_ec_item_metadata(request.mm_features, self.resolver)
        for mm_hash, item in items.items():
            if not announce(mm_hash):
                item["metadata"] = {}
        return items or None
