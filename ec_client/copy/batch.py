"""cudaMemcpyBatchAsync through ctypes, on the CUDA runtime torch loaded.

A fragmented entry is many copies: 64 MiB in shuffled 64 KiB pages is 1,024.
CUDA 12.8 added cudaMemcpyBatchAsync, one call for many independent copies
(in stream order as a whole, in no order among themselves). torch's
`cudart()` binding does not expose it, so it is called here, in the libcudart
this process has loaded (torch's: another copy of the runtime would have its
own current device and error state). Its signature changed in CUDA 13:

    12.8-12.9: (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx, stream)
    13.0+:     (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream)

so the version the runtime reports (cudaRuntimeGetVersion) picks the
prototype. Every copy gets one attribute, source access in stream order
(`cudaMemcpySrcAccessOrderStream`): sources are device memory or registered
host memory written before the copy was queued. Pageable host memory is
never batched (the caller copies it one call at a time). A runtime without
the call, or one that refuses a batch, leaves the caller to copy one by one;
a refusal is cleared and logged once, and the batch is not tried again.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Sequence

log = logging.getLogger(__name__)

SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream
FIRST_VERSION = 12080  # CUDA 12.8
NO_FAIL_INDEX = 13000  # CUDA 13: the failIdx argument is gone


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation),
                ("dstLocHint", _MemLocation), ("flags", ctypes.c_uint)]


def loaded_cudart() -> ctypes.CDLL | None:
    """The libcudart this process has loaded (torch's first), found in
    /proc/self/maps, or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
    except OSError:
        return None
    found = None
    for path in sorted(paths, key=lambda p: ("torch" not in p and "nvidia" not in p, p)):
        try:
            found = ctypes.CDLL(path)
            break
        except OSError:
            continue
    if len(paths) > 1:
        log.warning("ec-daemon: %d CUDA runtimes are loaded (%s); using %s", len(paths),
                    ", ".join(sorted(paths)), found and found._name)
    return found


class BatchCopy:
    """One cudaMemcpyBatchAsync for many copies, where the runtime has it."""

    def __init__(self, cudart: ctypes.CDLL | None) -> None:
        self._cudart = cudart
        self._lock = threading.Lock()
        self.version = 0
        self._fn = None
        if cudart is None:
            return
        version = ctypes.c_int(0)
        get_version = getattr(cudart, "cudaRuntimeGetVersion", None)
        if get_version is None or get_version(ctypes.byref(version)) != 0:
            return
        self.version = version.value
        fn = getattr(cudart, "cudaMemcpyBatchAsync", None)
        if fn is None or self.version < FIRST_VERSION:
            return
        args = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p),
                ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t,
                ctypes.POINTER(_MemcpyAttributes), ctypes.POINTER(ctypes.c_size_t),
                ctypes.c_size_t]
        if self.version < NO_FAIL_INDEX:
            args.append(ctypes.POINTER(ctypes.c_size_t))
        fn.argtypes = [*args, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        self._fn = fn

    @property
    def available(self) -> bool:
        return self._fn is not None

    def __call__(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int],
                 stream: int) -> bool:
        """Queue the copies on `stream` in one call; False (nothing to rely
        on: copy them one by one) when the runtime has no batch or refused."""
        fn = self._fn
        if fn is None:
            return False
        count = len(sizes)
        attrs = _MemcpyAttributes(SRC_ACCESS_ORDER_STREAM, _MemLocation(), _MemLocation(), 0)
        index = ctypes.c_size_t(0)
        args: list[object] = [(ctypes.c_void_p * count)(*dsts),
                              (ctypes.c_void_p * count)(*srcs),
                              (ctypes.c_size_t * count)(*sizes), count, ctypes.byref(attrs),
                              ctypes.byref(index), 1]
        if self.version < NO_FAIL_INDEX:
            args.append(ctypes.byref(ctypes.c_size_t(0)))
        error = fn(*args, ctypes.c_void_p(stream))
        if error == 0:
            return True
        assert self._cudart is not None
        self._cudart.cudaGetLastError()  # else it surfaces at an unrelated call
        with self._lock:
            if self._fn is not None:
                self._fn = None
                log.warning("ec-daemon: cudaMemcpyBatchAsync failed (CUDA error %d, runtime "
                            "%d); copies are queued one call each from now on", error,
                            self.version)
        return False
