"""`make gpu-bench` (CUDA only): H2D and D2H throughput of the torch and
cupy copy backends through the registered region, against cudaMemcpy
between pinned host memory (torch's pin_memory) and the device in the same
run, for 1 MiB to 1 GiB; plus the time to register the region.

    python -m benchmarks.gpu [--region-gib 4]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

import torch

from ec_client.copy import get_backend
from ec_client.mapping import RegionMapping

MiB = 1 << 20
SIZES = (MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1024 * MiB)


def _timed(fn: Any, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def _row(size: int, backends: dict[str, Any], mapping: RegionMapping) -> dict[str, Any]:
    repeat = max(3, min(20, (1024 * MiB) // size))
    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(size, dtype=torch.uint8).pin_memory()
    base_h2d = _timed(lambda: device.copy_(pinned, non_blocking=True), repeat)
    base_d2h = _timed(lambda: pinned.copy_(device, non_blocking=True), repeat)
    row: dict[str, Any] = {"bytes": size, "memcpy_h2d_gbps": size / base_h2d / 1e9,
                           "memcpy_d2h_gbps": size / base_d2h / 1e9}
    extents = [(0, size)]
    for name, backend in backends.items():
        d2h = _timed(lambda b=backend: b.save(device, mapping, extents), repeat)
        h2d = _timed(lambda b=backend: b.load(mapping, extents, device), repeat)
        row[f"{name}_d2h_ratio"] = base_d2h / d2h
        row[f"{name}_h2d_ratio"] = base_h2d / h2d
    return row


def run(region_bytes: int) -> dict[str, Any]:
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "rows": []}
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="bench-gpu-") as f:
        os.posix_fallocate(f.fileno(), 0, region_bytes)
        mapping = RegionMapping(f.name, region_bytes, generation=1)
        backends = {}
        for name in ("torch", "cupy"):
            try:
                backend = get_backend(name)
            except ImportError:
                continue
            started = time.perf_counter()
            backend.attach(mapping)
            results[f"{name}_register_s"] = time.perf_counter() - started
            backends[name] = backend
        results["rows"] = [_row(size, backends, mapping) for size in SIZES
                           if size <= region_bytes]
        for backend in backends.values():
            backend.detach(mapping)
        mapping.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--region-gib", type=int, default=2)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu-bench needs CUDA")
    results = run(args.region_gib << 30)
    for key, value in results.items():
        if key != "rows":
            print(f"{key}: {value}")
    columns = list(results["rows"][0])
    print("  ".join(f"{c:>16}" for c in columns))
    for row in results["rows"]:
        print("  ".join(f"{row[c]:>16.3f}" if isinstance(row[c], float) else f"{row[c]:>16}"
                        for c in columns))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
