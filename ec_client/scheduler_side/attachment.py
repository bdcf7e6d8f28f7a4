"""The scheduler's attachment: which daemon session its hits are answered
for, and what the link's events (`LinkListener`: the opening message, attach,
each daemon message, detach, heartbeats) do to the view, the wants and the
rank mapping.

The region's generation outlives a detach: a restarted daemon may adopt the
region this view loaded from, and then the loads in flight stay counted
across the restart (declared in the new session's opening message, `holds`;
workers keep the old region mapped and nobody reuses its pages). Another
region's attachment starts the view over.

Threads: the link calls these on its thread (`beat_due` also on gRPC's
request thread: it only asks the view). The engine's thread reads
`current`, `wanting` and `producer_claims`: each is one reference, replaced
whole. `on_attached` clears the view before it publishes `current`, so an
entry read after `current` is never paired with another region
(`SchedulerDelegate.stage` reads them in that order, and says why).
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

from ec_client.common.contract import RegionInfo
from ec_client.common.session import Attachment, LinkListener
from ec_client.common.trust import attached_socket_owner, open_region
from ec_client.common.wire import DaemonNews, EntryRef, Heartbeat, Outgoing, Touch
from ec_client.scheduler_side.rank_mapping import RankMapping
from ec_client.scheduler_side.staging import Staging
from ec_client.scheduler_side.stats import SchedulerStats
from ec_client.scheduler_side.view import ReadyView, Send
from ec_client.scheduler_side.wants import Wants
from ec_protocol.protocol import MAX_BATCH
from ec_protocol.transport import Transport

log = logging.getLogger(__name__)


class Current(NamedTuple):
    """The attachment hits are answered for, the view epoch it filled, the
    lineage its loads in flight count in, and its namespace."""

    region: RegionInfo
    epoch: int
    lineage: int
    namespace: str


class SchedulerAttachment(LinkListener):
    def __init__(self, transport: Transport, send_acks: Send, *, view: ReadyView,
                 wants: Wants, staging: Staging, rank_mapping: RankMapping,
                 stats: SchedulerStats) -> None:
        """`transport`: the link's (its socket's owner must be the daemon's
        user). `send_acks`: the view's acknowledgements, on the session stream."""
        self.transport = transport
        self._send_acks = send_acks
        self.view = view
        self.wants = wants
        self.staging = staging
        self.rank_mapping = rank_mapping
        self.stats = stats
        self.current: Current | None = None
        self.generation: int | None = None  # of the last attachment, kept while detached
        self.wanting = False  # wants help here (NamespaceInfo)
        self.producer_claims = False  # the daemon takes a producer's wants (at attach)

    def opening_message(self, attachment: Attachment) -> Outgoing | None:
        """The new session's first message: when its region is the one this
        view loaded from (a restarted daemon adopted it), the loads still in
        flight (`holds`), so the daemon keeps their pages for this session
        before it lets the previous daemon's ghost of this engine go. At most
        MAX_BATCH distinct entries: far more than one engine loads at once."""
        if attachment.region.generation != self.generation:
            return None
        loading = self.view.loading()
        if len(loading) > MAX_BATCH:
            log.warning("ec-daemon: %d entries loading across the restart; %d declared",
                        len(loading), MAX_BATCH)
        return Outgoing(holds=[EntryRef(h, e) for h, e in loading[:MAX_BATCH]])

    def on_attached(self, attachment: Attachment) -> None:
        """A new session: the view starts over. When the region is the one
        this view loaded from (a restarted daemon adopted it), loads in flight
        stay counted (they were declared in the opening message)."""
        owner = attached_socket_owner(self.transport.uri)  # a stranger's socket raises
        # Hits are answered only for a region this host's workers can map: a
        # region missing here (a client left in a restarted container's old
        # /dev/shm) or not the daemon's raises, and the link tries again later.
        os.close(open_region(attachment.region.path, owner))
        self.staging.region_owner = owner
        self.wanting = False  # until the new session's NamespaceInfo
        self.producer_claims = attachment.producer_claims
        self.rank_mapping.attached()  # not ready until the new session's EngineRanks
        self.wants.clear()
        same_region = attachment.region.generation == self.generation
        self.generation = attachment.region.generation
        self.view.clear(keep_loads=same_region)
        self.current = Current(attachment.region, self.view.epoch, self.view.lineage,
                               attachment.namespace)
        log.info("ec-daemon scheduler session %d attached (generation %016x%s, namespace %r)",
                 attachment.index, attachment.region.generation,
                 ", the same region" if same_region else "", attachment.namespace)

    def on_detached(self) -> None:
        self.current = None
        self.wanting = False
        self.rank_mapping.detached()
        # Loads in flight stay counted until the next attachment says whether
        # its region is the same one.
        self.view.clear(keep_loads=True)

    def on_message(self, message: DaemonNews) -> None:
        self.view.apply(message, self._send_acks)  # ready events before the answers
        if message.answers:
            self.wants.answered(message.answers)
        info = message.namespace_info
        if info is not None:
            wanting = info.engines > 1 or info.remote_tier
            if wanting != self.wanting:
                log.info("ec-daemon: %d engine(s) share this namespace%s: misses %s asked about",
                         info.engines, ", a second tier is on" if info.remote_tier else "",
                         "are" if wanting else "are no longer")
            self.wanting = wanting
        if message.ranks is not None:
            self.rank_mapping.changed(message.ranks.mapped, message.ranks.world_size)

    def beat_due(self) -> bool:
        """Loads to touch: the daemon's LRU hears of them within
        EARLY_BEAT_SECONDS, not a whole heartbeat interval later."""
        return self.view.has_touches()

    def heartbeat_message(self) -> Outgoing:
        self.rank_mapping.warn_if_overdue()
        lookups, hits = self.stats.lookups_since("heartbeat")
        touches = self.view.take_touches()
        return Outgoing(heartbeat=Heartbeat(lookups=lookups, hits=hits),
                        touches=[Touch(h, e, n) for h, e, n in touches])
