"""Which regions the workers keep mapped (`StepMetadata.keep`): the one the
scheduler is attached to, and every one a load in flight reads.

A load dispatched before a daemon restart still reads the old region, so a
region stays kept until its last load in flight landed (reported by every
rank, or given up); workers release a mapping no step keeps. The set is
rebuilt only when it changed: a region's first load sent, its last landed,
or another attachment. This process's reader (`RegionReader`: loads staged
here) unmaps every region the set does not name.

Not thread-safe: vLLM's scheduling thread calls everything here.
"""

from __future__ import annotations

from ec_client.common.readback import RegionReader


class KeptRegions:
    def __init__(self, reader: RegionReader) -> None:
        """`reader`: this process's region reader, told what is kept."""
        self.reader = reader
        self._loading: dict[int, int] = {}  # generation -> loads in flight
        self._keep: tuple[int | None, frozenset[int]] | None = None

    def sent(self, generation: int) -> None:
        """A load of region `generation` is in flight."""
        count = self._loading.get(generation, 0)
        self._loading[generation] = count + 1
        if not count:
            self._keep = None

    def landed(self, generation: int) -> None:
        """A load of region `generation` is no longer in flight."""
        left = self._loading.get(generation, 0) - 1
        if left > 0:
            self._loading[generation] = left
        elif self._loading.pop(generation, None) is not None:
            self._keep = None  # the generation left StepMetadata.keep

    def keep(self, generation: int | None) -> frozenset[int]:
        """StepMetadata.keep while attached to region `generation`: those of
        the loads in flight and that one; rebuilt only when it changed."""
        cached = self._keep
        if cached is not None and cached[0] == generation:
            return cached[1]
        keep = frozenset(self._loading) | ({generation} if generation is not None else set())
        self._keep = (generation, keep)
        self.reader.retain(keep)
        return keep
