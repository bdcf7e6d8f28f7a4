"""What the entries' checksum costs (issue 40): on the saver's path, on a
loader's (`ec_daemon_verify_checksum`), and the daemon's check of a reported
mismatch.

- A save's copy on the save rank's saver thread: the cpu backend's copy of
  an output into a real /dev/shm region file (the baseline, in the same
  run), then that copy and the xxh3-64 of the pages that landed, read back
  from the file with pread a MiB at a time, as the saver does (never through
  a mapping: a worker that truncates the file would make it a SIGBUS). The
  ratio is what the saver thread spends per save with the checksum over
  without; the engine's thread spends nothing either way (the saver runs
  beside it).
- A load's copy on a worker (`WorkerDelegate.load`): the cpu backend's copy
  of an entry out of the region file into an output (the baseline), then
  that copy and the check `ec_daemon_verify_checksum` adds: the xxh3-64 of
  the output (the cpu backend's outputs are host memory), and of the
  region's pages read back with pread (what a CUDA worker reads on the host
  after its copy landed; its device copy's own time is benchmarks/gpu.py's).
  The ratio is what a load costs with the check over without: under 1.05
  would make it the default.
- The daemon's check of an entry a loader reported: pread of its pages and
  their xxh3-64 (off the event loop), against the pread alone.

Entries of 1, 8 and 64 MiB, one extent each (the allocator's usual case);
each pair interleaved and best of N, so both see the same cache state.

    python -m benchmarks.checksums [--quick]
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
from typing import Any

import numpy as np

from benchmarks.micro import _best_of_pair
from benchmarks.tables import table
from ec_client.copy import get_backend
from ec_client.copy.mapping import RegionMapping
from ec_protocol.checksums import checksum

MiB = 1 << 20
SIZES = (MiB, 8 * MiB, 64 * MiB)
COLUMNS = ["what", "MiB", "baseline_ms", "with_checksum_ms", "ratio", "checksum_gbps"]


def measure(sizes: tuple[int, ...] = SIZES, repeat: int = 20) -> list[dict[str, Any]]:
    backend = get_backend("cpu")
    rows: list[dict[str, Any]] = []
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="bench-checksum-") as f:
        os.posix_fallocate(f.fileno(), 0, max(sizes))
        mapping = RegionMapping(f.name, max(sizes), generation=1)
        try:
            for size in sizes:
                rows += _rows(backend, mapping, f.fileno(), size, repeat)
        finally:
            gc.collect()
            mapping.close()
    return rows


def _rows(backend: Any, mapping: RegionMapping, fd: int, size: int,
          repeat: int) -> list[dict[str, Any]]:
    source = backend.empty((size,), "uint8")  # (aligned, as an engine's output is)
    source[:] = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    extents = [(0, size)]

    def save() -> None:
        backend.save(source, mapping, extents)

    def save_and_sum() -> None:
        backend.save(source, mapping, extents)
        checksum(mapping.chunks(extents))

    out = backend.empty((size,), "uint8")  # (aligned, as a load's output is)

    def load() -> None:
        backend.load(mapping, extents, out)

    def load_and_sum_output() -> None:
        backend.load(mapping, extents, out)
        checksum([backend.loaded_bytes(out)])

    def load_and_sum_pages() -> None:
        backend.load(mapping, extents, out)
        checksum(mapping.chunks(extents))

    def pread() -> bytes:
        return os.pread(fd, size, 0)

    def pread_and_sum() -> None:
        checksum([os.pread(fd, size, 0)])

    times = max(3, min(repeat, (512 * MiB) // size))
    with_sum, alone = _best_of_pair(save_and_sum, save, times)
    checked, read = _best_of_pair(pread_and_sum, pread, times)
    output_sum, copied = _best_of_pair(load_and_sum_output, load, times)
    pages_sum, copied_again = _best_of_pair(load_and_sum_pages, load, times)
    mib = size // MiB
    return [
        {"what": "save's copy (saver thread)", "MiB": mib, "baseline_ms": alone * 1e3,
         "with_checksum_ms": with_sum * 1e3, "ratio": with_sum / alone,
         "checksum_gbps": size / max(1e-9, with_sum - alone) / 1e9},
        {"what": "load (cpu: its output)", "MiB": mib, "baseline_ms": copied * 1e3,
         "with_checksum_ms": output_sum * 1e3, "ratio": output_sum / copied,
         "checksum_gbps": size / max(1e-9, output_sum - copied) / 1e9},
        {"what": "load (CUDA: the pages, host side)", "MiB": mib,
         "baseline_ms": copied_again * 1e3, "with_checksum_ms": pages_sum * 1e3,
         "ratio": pages_sum / copied_again,
         "checksum_gbps": size / max(1e-9, pages_sum - copied_again) / 1e9},
        {"what": "daemon's check of a report", "MiB": mib, "baseline_ms": read * 1e3,
         "with_checksum_ms": checked * 1e3, "ratio": checked / read,
         "checksum_gbps": size / max(1e-9, checked - read) / 1e9},
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (checks it runs)")
    args = parser.parse_args()
    rows = measure(repeat=3 if args.quick else 20)
    print(table("checksums: what they cost a save, a load and a reported mismatch's check "
                "(ratio = with / baseline, same run)", rows, COLUMNS))


if __name__ == "__main__":
    main()
