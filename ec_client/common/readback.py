"""An entry's bytes read from the region on the host, and the checks a
loader makes of them: every page still carries the entry's stamp, and the
bytes hash to the checksum its writer recorded (`ec_protocol.checksums`;
0: none recorded).

The scheduler's process uses `RegionReader` to stage a load itself when its
workers will not run the step that would have staged it (vLLM's V1 model
runner runs no connector in a step that schedules no tokens: see
`ec_client.scheduler_side.staging`); it copies the entry into private
memory, then checks the stamps (after the copy: pages reused during it
carry another stamp by then) and the checksum of the private copy, which is
what the workers receive.

Both processes import it (`common`): plain host memory, no copy backend.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterable

from ec_client.common.contract import (
    CHECKSUM_MISMATCH,
    STAMP_MISMATCH,
    UNUSABLE,
    LoadSpec,
    RegionInfo,
)
from ec_client.common.trust import open_region
from ec_protocol.checksums import checksum
from ec_protocol.dtypes import entry_problem
from ec_protocol.stamps import FREE, StampTable


class LoadRefused(Exception):
    """A load whose bytes cannot be used: `kind` is one of the contract's
    failure kinds, the message says why."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind




class _Mapping:
    def __init__(self, info: RegionInfo, expected_uid: int | None) -> None:
        fd = open_region(info.path, expected_uid, writable=False)
        try:
            if os.fstat(fd).st_size < info.size:
                raise OSError(f"region {info.path} is shorter than {info.size} bytes")
            self._mmap = mmap.mmap(fd, info.size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self.info = info
        self.view = memoryview(self._mmap)
        self.stamps = StampTable(self.view[:info.data_offset], info.page_bytes,
                                 info.data_offset)

    def close(self) -> None:
        self.stamps.release()
        self.view.release()
        with contextlib.suppress(BufferError):
            self._mmap.close()


class RegionReader:
    """Read-only mappings of the regions loads name, by generation. Not
    thread-safe (the scheduler's engine thread)."""

    def __init__(self) -> None:
        self._mapped: dict[int, _Mapping] = {}

    def read(self, spec: LoadSpec, info: RegionInfo | None, expected_uid: int | None = None,
             verify_checksum: bool = False) -> bytearray:
        """The entry's bytes, copied out of its region and verified: its
        stamps, its checksum with `verify_checksum` (where its writer
        recorded one), and its dtype and size (what a loader can make).
        Raises LoadRefused (STAMP_MISMATCH, CHECKSUM_MISMATCH, UNUSABLE)."""
        problem = entry_problem(spec.nbytes, spec.shape, spec.dtype)
        if problem is not None:
            raise LoadRefused(UNUSABLE, problem)
        if info is None or info.generation != spec.generation:
            raise LoadRefused(UNUSABLE, f"no region of generation {spec.generation:016x}")
        if spec.entry_id == FREE:
            raise LoadRefused(UNUSABLE, "entry id 0 names no entry (it is the stamp of free pages)")
        try:
            mapping = self._mapped.get(spec.generation)
            if mapping is None:
                mapping = self._mapped[spec.generation] = _Mapping(info, expected_uid)
            payload = bytearray(spec.nbytes)
            done = 0
            for offset, length in spec.extents:
                if offset < info.data_offset or length < 0 or offset + length > info.size \
                        or done + length > spec.nbytes:
                    raise LoadRefused(UNUSABLE, f"extent {offset}+{length} is outside the region "
                                            "or the entry")
                payload[done:done + length] = mapping.view[offset:offset + length]
                done += length
            if done != spec.nbytes:
                raise LoadRefused(UNUSABLE, f"extents hold {done} bytes, the entry {spec.nbytes}")
        except OSError as exc:
            raise LoadRefused(UNUSABLE, f"{type(exc).__name__}: {exc}") from None
        if not mapping.stamps.holds(spec.extents, spec.entry_id):  # after the copy
            raise LoadRefused(STAMP_MISMATCH, "its pages were reused (stamp mismatch): the bytes "
                                          "are not the entry's")
        if verify_checksum and spec.checksum and checksum((payload,)) != spec.checksum:
            raise LoadRefused(CHECKSUM_MISMATCH, "its bytes do not match the checksum its writer "
                                             "recorded: another process rewrote them")
        return payload

    def retain(self, generations: Iterable[int]) -> None:
        """Unmap every region but these generations."""
        keep = set(generations)
        for generation in [g for g in self._mapped if g not in keep]:
            self._mapped.pop(generation).close()

    def close(self) -> None:
        self.retain(())
