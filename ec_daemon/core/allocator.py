"""Page-extent allocator of the region.

The region is divided into pages; an allocation is a list of runs of
contiguous pages (extents), as few as the free space allows: the smallest free
run that fits the whole request (best fit), otherwise the largest runs first.
Freed runs coalesce with free neighbours at once, so free space is always a
set of maximal runs.

Narrow by design: it never evicts and `allocate` returns None when free pages
are short. Not thread-safe: the daemon's event loop is its only caller.
"""

from __future__ import annotations

import bisect

Run = tuple[int, int]  # (first page, number of pages)


class ExtentAllocator:
    def __init__(self, total_pages: int, free: list[Run] | None = None) -> None:
        """All pages free, or only the runs `free` (an adopted region: maximal,
        disjoint runs in address order)."""
        if total_pages <= 0:
            raise ValueError("an allocator needs at least one page")
        self.total_pages = total_pages
        self.free_pages = 0
        self._by_start: dict[int, int] = {}  # first page -> length
        self._by_end: dict[int, int] = {}  # one past the last page -> first page
        self._by_size: list[Run] = []  # sorted (length, first page)
        self._starts: list[int] = []  # sorted first pages, to refuse double frees
        if free is None:
            self._insert(0, total_pages)
            return
        end = 0
        for start, length in free:
            if start < end or length <= 0 or start + length > total_pages \
                    or (start == end and start > 0):
                raise ValueError(f"free run {start}+{length} overlaps, touches or leaves the "
                                 "region")
            end = start + length
            self._by_start[start] = length
            self._by_end[end] = start
            self._starts.append(start)
            self._by_size.append((length, start))
            self.free_pages += length
        self._by_size.sort()

    def allocate(self, pages: int) -> list[Run] | None:
        """Take `pages` pages as few runs; None (and no change) when short."""
        if pages <= 0:
            raise ValueError(f"cannot allocate {pages} pages")
        if pages > self.free_pages:
            return None
        runs: list[Run] = []
        need = pages
        while need:
            i = bisect.bisect_left(self._by_size, (need, -1))
            if i < len(self._by_size):  # best fit for what is left
                length, start = self._by_size[i]
                take = need
            else:  # nothing fits whole: take the largest run entirely
                length, start = self._by_size[-1]
                take = length
            self._remove(start, length)
            if length > take:
                self._insert(start + take, length - take)
            runs.append((start, take))
            need -= take
        return runs

    def free(self, runs: list[Run]) -> None:
        """Return runs taken by `allocate`. Raises ValueError on a double free."""
        for start, length in runs:
            if start < 0 or length <= 0 or start + length > self.total_pages:
                raise ValueError(f"run {start}+{length} is outside the region")
            if self._overlaps_free(start, length):
                raise ValueError(f"run {start}+{length} is already free")
            left = self._by_end.get(start)
            if left is not None:
                left_len = self._by_start[left]
                self._remove(left, left_len)
                start, length = left, length + left_len
            right_len = self._by_start.get(start + length)
            if right_len is not None:
                self._remove(start + length, right_len)
                length += right_len
            self._insert(start, length)

    def runs(self) -> list[Run]:
        """The free runs, in address order."""
        return [(start, self._by_start[start]) for start in self._starts]

    @property
    def largest_free_run(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def free_runs(self) -> int:
        return len(self._by_size)

    def _overlaps_free(self, start: int, length: int) -> bool:
        # Only the free run starting at or before `start` and the next one can overlap.
        i = bisect.bisect_right(self._starts, start) - 1
        for j in (i, i + 1):
            if 0 <= j < len(self._starts):
                s = self._starts[j]
                if s < start + length and start < s + self._by_start[s]:
                    return True
        return False

    def _insert(self, start: int, length: int) -> None:
        self._by_start[start] = length
        self._by_end[start + length] = start
        bisect.insort(self._by_size, (length, start))
        bisect.insort(self._starts, start)
        self.free_pages += length

    def _remove(self, start: int, length: int) -> None:
        del self._by_start[start]
        del self._by_end[start + length]
        i = bisect.bisect_left(self._by_size, (length, start))
        del self._by_size[i]
        del self._starts[bisect.bisect_left(self._starts, start)]
        self.free_pages -= length
