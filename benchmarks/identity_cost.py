"""What identifying a model's weights costs (ec_client.identity), counted in
file system operations and bytes, and what that makes on a network file
system.

Every process of an engine (its scheduler and each worker rank) identifies
the weights once at start-up. On NFS each metadata operation (stat, lstat,
open, a directory listing) costs about one round trip when the attribute
cache is cold, and each read one round trip per rsize bytes. This counts
the operations `weights_identity` makes on realistic checkpoint layouts
built here (weight files are sparse: their size is real, their blocks are
not on disk), then models the time at a given round trip and rsize, and
also measures it with every operation slowed by that round trip (a slow
file system simulated in-process; no mount is needed).

    python -m benchmarks.identity_cost [--rtt-ms 0.5 2] [--rsize 1MiB]
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ec_client import identity
from ec_protocol.sizes import parse_size

GIB = 1 << 30
MIB = 1 << 20
# Small files of a Hugging Face multimodal checkpoint (bytes, as published).
QWEN_VL_SMALL = {
    "config.json": 1_400, "generation_config.json": 220, "preprocessor_config.json": 350,
    "chat_template.json": 1_050, "tokenizer_config.json": 5_700,
    "tokenizer.json": 7_030_000, "vocab.json": 2_780_000, "merges.txt": 1_670_000,
    "model.safetensors.index.json": 57_600,
}
LAYOUTS = {
    # name: (shards, bytes per shard)
    "7B (5 shards of 3.9 GB)": (5, int(3.9e9)),
    "72B (38 shards of 3.9 GB)": (38, int(3.9e9)),
}


def build(folder: Path, shards: int, shard_bytes: int, hub: bool) -> Path:
    """A checkpoint folder; `hub`: a Hugging Face cache snapshot (symlinks
    into blobs named by their hash) instead of plain files."""
    snapshot = folder / ("snapshots/0123abcd" if hub else "model")
    snapshot.mkdir(parents=True)
    blobs = folder / "blobs"
    blobs.mkdir()
    names = dict(QWEN_VL_SMALL)
    for i in range(1, shards + 1):
        names[f"model-{i:05d}-of-{shards:05d}.safetensors"] = shard_bytes
    for n, (name, size) in enumerate(sorted(names.items())):
        target = blobs / f"{n:064x}" if hub else snapshot / name
        with open(target, "wb") as f:
            if size < MIB * 8:
                f.write(os.urandom(min(size, 4096)) * (size // 4096) + os.urandom(size % 4096))
            else:
                f.truncate(size)  # sparse
        if hub:
            (snapshot / name).symlink_to(target)
    return snapshot


class Counted:
    """os and open wrappers that count operations and bytes read, and sleep
    `delay_s` per round trip (`rsize` bytes a read round trip)."""

    def __init__(self, delay_s: float, rsize: int) -> None:
        self.ops: Counter[str] = Counter()
        self.bytes = 0
        self.delay_s = delay_s
        self.rsize = rsize

    def trip(self, name: str, nbytes: int = 0) -> None:
        self.ops[name] += 1
        self.bytes += nbytes
        trips = 1 + (max(0, nbytes - 1) // self.rsize if nbytes else 0)
        if self.delay_s:
            time.sleep(self.delay_s * trips)

    def wrap(self, name: str, real: Callable[..., Any],
             size_of: Callable[[Any], int] | None = None) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            out = real(*args, **kwargs)
            self.trip(name, size_of(out) if size_of else 0)
            return out
        return call

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        real_open = builtins.open
        counted = self

        class File:
            def __init__(self, f: Any) -> None:
                self._f = f

            def read(self, n: int = -1) -> bytes:
                data: bytes = self._f.read(n)
                counted.trip("read", len(data))
                return data

            def __enter__(self) -> File:
                return self

            def __exit__(self, *exc: Any) -> None:
                self._f.close()

        def opened(*args: Any, **kwargs: Any) -> Any:
            self.trip("open")
            return File(real_open(*args, **kwargs))

        patches = {
            (os, "stat"): self.wrap("stat", os.stat),
            (os, "lstat"): self.wrap("lstat", os.lstat),
            (os, "open"): self.wrap("open", os.open),
            (os, "fstat"): self.wrap("fstat", os.fstat),
            (os, "pread"): self.wrap("read", os.pread, len),
            (os, "scandir"): self.wrap("listdir", os.scandir),
            (builtins, "open"): opened,
        }
        saved = {key: getattr(*key) for key in patches}
        try:
            for (module, name), fn in patches.items():
                setattr(module, name, fn)
            yield
        finally:
            for (module, name), fn in saved.items():
                setattr(module, name, fn)


def measure(path: Path, delay_s: float, rsize: int) -> tuple[Counted, float]:
    counted = Counted(delay_s, rsize)
    with counted.installed():
        started = time.perf_counter()
        identity.weights_identity(str(path))
        took = time.perf_counter() - started
    return counted, took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rtt-ms", type=float, nargs="+", default=[0.5, 2.0])
    parser.add_argument("--rsize", default="1MiB")
    args = parser.parse_args()
    rsize = parse_size(args.rsize)
    print(f"{'layout':34} {'form':6} {'ops':>5} {'meta':>5} {'reads':>5} {'read MiB':>8} "
          + " ".join(f"{f'model {r:g}ms':>11} {f'sim {r:g}ms':>9}" for r in args.rtt_ms))
    for name, (shards, shard_bytes) in LAYOUTS.items():
        for hub in (False, True):
            with tempfile.TemporaryDirectory(prefix="ecd-identity-") as tmp:
                path = build(Path(tmp), shards, shard_bytes, hub)
                counted, _ = measure(path, 0.0, rsize)
                reads = counted.ops["read"]
                meta = sum(counted.ops.values()) - reads
                # Round trips: every metadata op one, every read one per rsize.
                trips = meta + reads + counted.bytes // rsize
                cells = []
                for rtt in args.rtt_ms:
                    _, took = measure(path, rtt / 1000, rsize)
                    cells.append(f"{trips * rtt:>9.0f}ms {took * 1000:>7.0f}ms")
                print(f"{name:34} {'hub' if hub else 'files':6} {sum(counted.ops.values()):>5} "
                      f"{meta:>5} {reads:>5} {counted.bytes / MIB:>8.2f} " + " ".join(cells))
    print("per process; an engine identifies once in its scheduler and once per worker rank, "
          "at the same time")


if __name__ == "__main__":
    main()
