"""`make gpu-bench` (CUDA only; part of `make gpu-check`): saves and loads of
the torch and cupy copy backends through a registered /dev/shm region against
cudaMemcpyAsync of the same bytes from pinned memory (a pinned torch tensor's
`copy_(non_blocking=True)`), measured in the same run; and what a load costs
the compute stream.

Entries of 1, 8 and 64 MiB start at non-zero offsets; one 64 MiB entry
crosses the 1 GiB registration chunk boundary and one is scattered over 64
extents of 1 MiB; and 8 and 64 MiB entries are fragmented into 64 KiB pages
in shuffled order (128 and 1,024 extents, a few of them adjacent), as a busy
daemon's allocator hands them out: the backends join adjacent pages and
queue the rest in one cudaMemcpyBatchAsync where CUDA has it (`batch` in the
results says whether it did). Each backend attaches
its own mapping of the region and detaches it before the next backend
attaches (registering pages twice is cudaErrorHostMemoryAlreadyRegistered),
and is timed only once its background registration finished.

The compute stream: a chain of sleep kernels (20 ms each) is queued on it
with one load after each kernel, once untimed first (the caching allocator
grows to its steady state there, not in the measured chain). A load that made the host wait for the
compute stream finds it idle when it returns (counted as a host sync), and
the stream then idles while the host queues the next kernel (the chain's
time against the same chain without loads, per load).

What `ec_daemon_verify_checksum` costs a GPU load: each load again, then the
xxh3-64 of its pages read on the host once the copy landed, as a CUDA
worker checks it (`verify_cost`: that load's time over the plain load's;
under 1.05 would make the check the default).

    python -m benchmarks.gpu [--json PATH]

With --json, the file is rewritten after every row, so a run that is
stopped keeps what it measured. `--dry-run` (no GPU) puts every case through
the copy path under the CPU model of CUDA's rules (tests/cuda_model.py):
extents inside the region, bytes round-tripped exactly; nothing is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.gpu_device import BENCH_REGION_BYTES as REGION_BYTES
from ec_client.copy import get_backend
from ec_client.copy.mapping import RegionMapping
from ec_client.copy.pinning import REGISTER_CHUNK_BYTES as CHUNK
from ec_protocol.checksums import checksum

MiB = 1 << 20
PAGE = 64 << 10


def fragmented(nbytes: int, start: int, seed: int) -> list[tuple[int, int]]:
    """`nbytes` in pages taken at random from twice as many at `start`, in
    shuffled order (some neighbours end up adjacent, as in a daemon's)."""
    pages = random.Random(seed).sample(range(2 * nbytes // PAGE), nbytes // PAGE)
    return [(start + p * PAGE, PAGE) for p in pages]


# (case, extents): the cases benchmarks/gpu_report.py's targets name come first.
CASES: list[tuple[str, list[tuple[int, int]]]] = [
    ("1 MiB", [(64 * MiB + PAGE, MiB)]),
    ("8 MiB", [(96 * MiB + PAGE, 8 * MiB)]),
    ("64 MiB", [(128 * MiB + PAGE, 64 * MiB)]),
    ("64 MiB across the 1 GiB chunk", [(CHUNK - 32 * MiB + PAGE, 64 * MiB)]),
    ("64 MiB in 64 extents of 1 MiB", [(256 * MiB + i * 2 * MiB, MiB) for i in range(64)]),
    ("8 MiB fragmented", fragmented(8 * MiB, 384 * MiB, 8)),
    ("64 MiB fragmented", fragmented(64 * MiB, 512 * MiB, 64)),
]
PIN_WAIT_S = 60.0
KERNEL_MS = 20.0
IDLE_LOADS = 20
IDLE_CASE = "8 MiB"


def _median_s(fn: Callable[[], Any], nbytes: int) -> float:
    repeat = 30 if nbytes <= 8 * MiB else 10
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _memcpy_baseline(nbytes: int, device: torch.device) -> tuple[float, float]:
    """(D2H, H2D) seconds of one cudaMemcpyAsync between pinned memory and the device."""
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.current_stream(device)

    def d2h() -> None:
        pinned.copy_(on_device, non_blocking=True)
        stream.synchronize()

    def h2d() -> None:
        on_device.copy_(pinned, non_blocking=True)
        stream.synchronize()

    return _median_s(d2h, nbytes), _median_s(h2d, nbytes)


def _rows(name: str, backend: Any, mapping: RegionMapping, rows: list[dict[str, Any]],
          written: Callable[[], None]) -> None:
    """Each case's row appended to `rows`, `written` called after each."""
    for case, extents in CASES:
        nbytes = sum(length for _, length in extents)
        base_d2h, base_h2d = _memcpy_baseline(nbytes, backend.device)
        source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=backend.device)

        def save(source: torch.Tensor = source, extents: list[tuple[int, int]] = extents) -> None:
            backend.save(source, mapping, extents, backend.prepare_save(source))

        def load(nbytes: int = nbytes, extents: list[tuple[int, int]] = extents) -> None:
            backend.load(mapping, extents, backend.empty((nbytes,), "uint8"))

        def verified_load(nbytes: int = nbytes, extents: list[tuple[int, int]] = extents
                          ) -> None:
            backend.load(mapping, extents, backend.empty((nbytes,), "uint8"))
            checksum(mapping.view[offset:offset + length] for offset, length in extents)

        save_s, load_s = _median_s(save, nbytes), _median_s(load, nbytes)
        verified_s = _median_s(verified_load, nbytes)
        out = backend.empty((nbytes,), "uint8")
        backend.load(mapping, extents, out)
        rows.append({"case": case, "backend": name, "bytes": nbytes, "extents": len(extents),
                     "bit_exact": bool(torch.equal(out, source)),
                     "save_gbps": nbytes / save_s / 1e9, "load_gbps": nbytes / load_s / 1e9,
                     "memcpy_d2h_gbps": nbytes / base_d2h / 1e9,
                     "memcpy_h2d_gbps": nbytes / base_h2d / 1e9,
                     "save_ratio": base_d2h / save_s, "load_ratio": base_h2d / load_s,
                     "verify_cost": verified_s / load_s})
        written()


def _sleep_cycles(device: torch.device, ms: float) -> int:
    """torch.cuda._sleep cycles that keep `device` busy for about `ms`."""
    probe = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.device(device):
        torch.cuda._sleep(probe)  # warm-up
        start.record()
        torch.cuda._sleep(probe)
        end.record()
    end.synchronize()
    return int(probe * ms / start.elapsed_time(end))


def _chain_ms(device: torch.device, cycles: int, load: Callable[[], Any] | None,
              ) -> tuple[float, int]:
    """(ms the compute stream took for IDLE_LOADS sleep kernels, with `load`
    called after queueing each; how many loads found the stream idle)."""
    stream = torch.cuda.current_stream(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host_syncs = 0
    torch.cuda.synchronize(device)
    with torch.cuda.device(device):
        start.record(stream)
        for _ in range(IDLE_LOADS):
            torch.cuda._sleep(cycles)
            if load is not None:
                out = load()
                host_syncs += int(stream.query())  # the kernel queued just now is done
                out[:1].clone()  # the compute stream consumes the load, after its event
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end), host_syncs


def _compute_stream(backend: Any, mapping: RegionMapping) -> dict[str, Any]:
    extents = dict(CASES)[IDLE_CASE]
    nbytes = sum(length for _, length in extents)
    cycles = _sleep_cycles(backend.device, KERNEL_MS)

    def load() -> Any:
        return backend.load(mapping, extents, backend.empty((nbytes,), "uint8"))

    _chain_ms(backend.device, cycles, load)  # warm-up: the allocator's pool grows here
    alone, _ = _chain_ms(backend.device, cycles, None)
    with_loads, host_syncs = _chain_ms(backend.device, cycles, load)
    return {"case": IDLE_CASE, "loads": IDLE_LOADS, "kernel_ms": alone / IDLE_LOADS,
            "host_syncs": host_syncs, "host_syncs_per_load": host_syncs / IDLE_LOADS,
            "idle_ms_per_load": max(0.0, with_loads - alone) / IDLE_LOADS}


def _measure_backend(name: str, path: str, result: dict[str, Any],
                     written: Callable[[], None]) -> None:
    """One backend on its own mapping of the region, detached before
    returning; `result` filled in as it is measured."""
    try:
        backend: Any = get_backend(name)
    except Exception as exc:  # no cupy, no CUDA for it: the other backend still runs
        result["error"] = f"{type(exc).__name__}: {exc}"
        return
    batch = getattr(backend.runtime, "batch", None)
    result["batch"] = bool(batch is not None and batch.available)
    mapping = RegionMapping(path, REGION_BYTES, generation=1)
    try:
        started = time.perf_counter()
        backend.attach(mapping)
        while not backend.pinned(mapping) and time.perf_counter() - started < PIN_WAIT_S:
            time.sleep(0.005)
        result["register_s"] = time.perf_counter() - started
        result["pinned"] = bool(backend.pinned(mapping))
        written()
        _rows(name, backend, mapping, result.setdefault("rows", []), written)
        result["compute_stream"] = _compute_stream(backend, mapping)
        result["stats"] = dict(backend.stats)
    except Exception as exc:  # recorded: the other backend still runs
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        try:
            backend.detach(mapping)
        except Exception as exc:
            result.setdefault("error", f"detach: {type(exc).__name__}: {exc}")
        mapping.close()
        written()


def run(json_path: str | None = None) -> dict[str, Any]:
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(),
                               "region_bytes": REGION_BYTES, "backends": []}

    def written() -> None:
        if json_path:
            part = f"{json_path}.part"
            with open(part, "w") as f:
                json.dump(results, f, indent=1)
            os.replace(part, json_path)

    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="bench-gpu-") as f:
        os.posix_fallocate(f.fileno(), 0, REGION_BYTES)
        for name in ("torch", "cupy"):
            results["backends"].append({"backend": name})
            _measure_backend(name, f.name, results["backends"][-1], written)
    return results


def print_results(results: dict[str, Any]) -> None:
    print(f"device: {results['device']}")
    for part in results["backends"]:
        if "error" in part:
            print(f"{part['backend']}: ERROR {part['error']}")
        if "register_s" in part:
            print(f"{part['backend']}: registered in {part['register_s']:.2f}s "
                  f"(pinned: {part['pinned']}, batched copies: {part.get('batch')}), "
                  f"stats {part.get('stats')}")
        for row in part.get("rows", []):
            print(f"  {row['case']:>32}  save {row['save_gbps']:6.1f} GB/s "
                  f"({row['save_ratio']:.2f}x memcpy)  load {row['load_gbps']:6.1f} GB/s "
                  f"({row['load_ratio']:.2f}x memcpy)  bit-exact {row['bit_exact']}  "
                  f"checksum check {row.get('verify_cost', float('nan')):.2f}x a load")
        if "compute_stream" in part:
            c = part["compute_stream"]
            print(f"  compute stream: {c['host_syncs_per_load']:.2f} host syncs per load, "
                  f"{c['idle_ms_per_load']:.3f} ms idle per load ({c['case']} loads)")


def dry_run(folder: str = "/dev/shm") -> list[dict[str, Any]]:
    """Every case saved and loaded through the CUDA copy path under the CPU
    model (registered in 1 GiB chunks, the compute stream busy), checked
    bit-exact; rows without timings."""
    from tests.cuda_model import Backend, as_host

    rows = []
    with tempfile.NamedTemporaryFile(dir=folder, prefix="bench-gpu-dry-") as f:
        f.truncate(REGION_BYTES)
        mapping = RegionMapping(f.name, REGION_BYTES, generation=1)
        backend = Backend(chunk_bytes=CHUNK, busy_compute=True, wait_pinned=True)
        backend.attach(mapping)
        try:
            for case, extents in CASES:
                nbytes = sum(length for _, length in extents)
                source = backend.model.to_device(torch.randint(0, 256, (nbytes,),
                                                               dtype=torch.uint8))
                backend.save(source, mapping, extents, backend.prepare_save(source))
                out = backend.load(mapping, extents, backend.empty((nbytes,), "uint8"))
                rows.append({"case": case, "bytes": nbytes, "extents": len(extents),
                             "bit_exact": as_host(out).tobytes() == as_host(source).tobytes(),
                             "copy_calls": backend.model.copy_calls,
                             "batch_calls": backend.model.batch_calls})
                del out, source
            backend.model.drain()
            if backend.model.violations:
                raise RuntimeError(f"the copy path broke CUDA's rules: {backend.model.violations}")
        finally:
            backend.detach(mapping)
            mapping.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: every case through the CPU model of CUDA's rules")
    args = parser.parse_args()
    if args.dry_run:
        rows = dry_run()
        for row in rows:
            print(row)
        raise SystemExit(0 if all(r["bit_exact"] for r in rows) else 1)
    if not torch.cuda.is_available():
        raise SystemExit("gpu-bench needs CUDA (a CUDA build of torch and a GPU)")
    results = run(args.json)
    print_results(results)
    if any("error" in part for part in results["backends"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
