"""Whether every worker rank of the engine mapped the session's region.

Hits are answered only once they all have (the daemon counts their open
session streams and says so on the scheduler's stream, `EngineRanks`): a
rank that cannot map the region (another container's /dev/shm, another
node) would fail the load, so the engine misses instead. Every rank means
the engine's own world size (vLLM: tp x pcp), or what the ranks attached
with if larger. Ranks still not all mapped a while after an attach or a
rank's loss are warned about, once, on a heartbeat: engines start their
scheduler before their workers and stop their workers first, so a short
gap is normal. Written on the link's thread, read on the engine's: each
field is one reference, replaced whole.
"""

from __future__ import annotations

import logging
import time

from ec_client.common.limits import UNMAPPED_WARNING_SECONDS

log = logging.getLogger(__name__)


class RankMapping:
    def __init__(self, world_size: int) -> None:
        """`world_size`: how many distinct worker ranks must have mapped the region."""
        self.world_size = world_size
        self.ready = False  # every rank mapped the session's region
        self.seen = (0, 1)  # (mapped, needed), as last told
        self._unmapped_since: float | None = None  # warned about on a heartbeat past a bound

    def attached(self) -> None:
        """A new session: not ready until its EngineRanks."""
        self.ready = False
        self._unmapped_since = time.monotonic()  # said on a heartbeat if it lasts

    def detached(self) -> None:
        self.ready = False

    def changed(self, mapped: int, world_size: int) -> None:
        """The daemon counted `mapped` distinct worker ranks of this engine
        instance (of a world of `world_size`, as they attached) with the
        region mapped; this engine needs its own `world_size` of them."""
        needed = max(self.world_size, world_size, 1)
        ready = mapped >= needed
        self.seen = (mapped, needed)
        if ready and not self.ready:
            log.info("ec-daemon: all %d worker ranks mapped the region; hits are answered", mapped)
            self._unmapped_since = None
        elif not ready and self.ready:  # a rank went away (or the engine stops)
            self._unmapped_since = time.monotonic()  # said on a heartbeat if it lasts
        self.ready = ready

    def warn_if_overdue(self) -> None:
        """On a heartbeat: ranks not all mapped for UNMAPPED_WARNING_SECONDS
        are warned about, once per attachment (or per rank lost)."""
        since = self._unmapped_since
        if since is not None and not self.ready \
                and time.monotonic() - since > UNMAPPED_WARNING_SECONDS:
            self._unmapped_since = None
            mapped, needed = self.seen
            log.warning("ec-daemon: %d of %d worker ranks mapped the region; every lookup "
                        "misses until all have (a rank in another /dev/shm, container or node "
                        "cannot load from this daemon)", mapped, needed)
