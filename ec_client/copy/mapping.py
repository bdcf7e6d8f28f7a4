"""A client's MAP_SHARED view of the daemon's region file.

The daemon only owns the file; each client process maps it itself. A mapping
belongs to one region generation: after a daemon restart the old file is gone
and extents of the old generation must never be read through a new mapping.
"""

from __future__ import annotations

import contextlib
import mmap
import os

from ec_client.common.trust import open_region


class RegionMapping:
    def __init__(self, path: str, size: int, generation: int, *,
                 expected_uid: int | None = None) -> None:
        """Map the region. `expected_uid`: the daemon's user (trust.socket_owner),
        the file's required owner besides root; None checks no owner.

        Raises OSError: FileNotFoundError when the daemon that announced it
        is gone (attach again); trust.UntrustedError for a symlink, a file
        that is not regular, or one of another owner (do not use the daemon).
        """
        fd = open_region(path, expected_uid)
        try:
            actual = os.fstat(fd).st_size
            if actual < size:
                raise OSError(f"region {path} is {actual} bytes, expected {size}")
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.path = path
        self.size = size
        self.generation = generation
        self.view = memoryview(self._mmap)

    def check(self, offset: int, length: int) -> None:
        """Raise ValueError unless [offset, offset+length) lies in the region."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(f"extent {offset}+{length} is outside the region ({self.size} bytes)")

    def close(self) -> None:
        self.view.release()
        # A copy may still hold a view: the mapping then goes with the last one.
        with contextlib.suppress(BufferError):
            self._mmap.close()
