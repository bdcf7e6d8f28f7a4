"""Helpers of the GPU tests: what CUDA needs, regions in /dev/shm.

Regions are real tmpfs files: recent kernels refuse long-term writable pins
of file mappings that need dirty tracking (a region under pytest's tmp_path
on disk), while /dev/shm is what the daemon uses. Each test creates and
removes its own files (prefix `ec-gpu-test-`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ec_client.copy.mapping import RegionMapping

SHM = Path("/dev/shm")
PREFIX = "ec-gpu-test-"
# The only skip a required run accepts: the test that needs a second GPU.
NEEDS_TWO_GPUS = "needs a second GPU"
PIN_WAIT_S = 60.0  # background registration, generously: ~0.1 s per GB


def cuda_problem() -> str | None:
    """Why CUDA tests cannot run with this Python, or None when they can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed for this Python: install a CUDA build of torch"
    if torch.version.cuda is None:
        return (f"torch {torch.__version__} is a CPU build: install a CUDA build "
                "(https://pytorch.org/get-started/locally/)")
    if not torch.cuda.is_available():
        return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device "
                "(no GPU, no driver, or CUDA_VISIBLE_DEVICES hides them)")
    return None


@functools.cache
def cupy_problem() -> str | None:
    """Why the cupy backend's tests cannot run, or None when they can."""
    try:
        import cupy
    except ImportError:
        return "cupy is not installed: install cupy-cuda13x, or cupy-cuda12x[ctk] for CUDA 12"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "cupy sees no CUDA device"
        (cupy.arange(4) * 2).get()  # an elementwise kernel: needs NVRTC
    except Exception as exc:  # cupy raises several types for a missing runtime
        return (f"cupy cannot run a kernel ({type(exc).__name__}: {exc}); "
                "cupy-cuda12x needs its [ctk] extra for NVRTC")
    return None


CUDA_PROBLEM = cuda_problem()
needs_cuda = pytest.mark.skipif(CUDA_PROBLEM is not None, reason=CUDA_PROBLEM or "")


def tested_nothing(passed: int, skip_reasons: list[str]) -> str | None:
    """Why a required GPU run must fail although nothing failed, or None:
    no test passed, or one skipped for another reason than a second GPU."""
    other = [r for r in skip_reasons if NEEDS_TWO_GPUS not in r]
    if passed == 0:
        return "no GPU test passed: this run tested nothing"
    if other:
        return f"{len(other)} GPU tests skipped (first: {other[0]})"
    return None


def get_backend_or_skip(name: str) -> Any:
    """The named backend; a missing cupy skips (which fails a required run)."""
    if name == "cupy" and (problem := cupy_problem()):
        pytest.skip(problem)
    from ec_client.copy import get_backend

    return get_backend(name)


@contextlib.contextmanager
def shm_region(size: int) -> Iterator[RegionMapping]:
    """A new sparse region file of `size` bytes in /dev/shm, mapped; removed after."""
    path = SHM / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with open(path, "wb") as f:
        f.truncate(size)
    mapping = RegionMapping(str(path), size, generation=1)
    try:
        yield mapping
    finally:
        mapping.close()
        path.unlink()


def wait_pinned(backend: Any, mapping: RegionMapping, timeout: float = PIN_WAIT_S) -> bool:
    """Until the backend's (background) registration of `mapping` finished."""
    deadline = time.monotonic() + timeout
    while not backend.pinned(mapping):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def host_pointer(mapping: RegionMapping) -> int:
    """The address of the mapping's first byte (no buffer export outlives this)."""
    anchor = ctypes.c_char.from_buffer(mapping.view)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


def pending_cuda_errors() -> list[int]:
    """cudaPeekAtLastError of every CUDA runtime loaded in this process, on
    this thread: a refused call must not leave its error to surface later
    at an unrelated torch call."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    return [code for code in (int(ctypes.CDLL(p).cudaPeekAtLastError()) for p in sorted(paths))
            if code != 0]


def pattern(seed: int, shape: tuple[int, ...], dtype: Any, device: Any) -> Any:
    """The same tensor in every process for the same arguments."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype).to(device)


def row_major_bytes(tensor: Any) -> bytes:
    import torch

    return tensor.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def stored_bytes(mapping: RegionMapping, extents: Any) -> bytes:
    return b"".join(bytes(mapping.view[offset:offset + length]) for offset, length in extents)


@contextlib.contextmanager
def canary_region(size: int) -> Iterator[tuple[str, int]]:
    """A new region file in /dev/shm as the daemon makes it (`size` bytes,
    then the trailer with a canary), allocated; (path, an open descriptor)
    for the test to cut and repair it with; removed after."""
    from ec_protocol.stamps import file_bytes

    path = SHM / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, file_bytes(size))
        repair(fd, size)
        yield str(path), fd
    finally:
        os.close(fd)
        path.unlink()


def repair(fd: int, size: int) -> int:
    """What the daemon does to a cut region: its size back, a new canary
    (every byte non-zero); returns the canary."""
    from ec_protocol.stamps import file_bytes, write_canary

    os.ftruncate(fd, file_bytes(size))
    os.posix_fallocate(fd, 0, file_bytes(size))
    canary = int.from_bytes(bytes(b % 255 + 1 for b in os.urandom(8)), "little")
    write_canary(fd, size, canary)
    return canary


def file_bytes_at(fd: int, extents: Any) -> bytes:
    """The file's bytes under `extents`, read with pread (a cut file reads short)."""
    return b"".join(os.pread(fd, length, offset) for offset, length in extents)
