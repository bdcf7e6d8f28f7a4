"""The test groups that need what a fresh machine may lack (redis-server,
libibverbs1, a Docker engine, CUDA, vLLM): one place for why each one skips
and which command runs it.

Every skip of a group says `LABEL: why; run with `COMMAND``, so the end of
the run (tests/conftest.py) can name each group that did not run from the
skip reasons alone, whether a marker, a fixture or a collection skipped it.
Groups whose files are not ours to word (tests/gpu) are known by folder too.

Standard library, pytest and tests.redis_servers/mooncake_servers only: the
vLLM suites import this from their own virtual environment.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from dataclasses import dataclass

import pytest

from tests import mooncake_servers, redis_servers


@dataclass(frozen=True)
class Group:
    label: str  # as the summary line names it
    command: str  # what runs it
    folder: str = ""  # a folder whose skips all belong to this group
    where: str = ""  # where the command can run, if not anywhere

    @property
    def run_with(self) -> str:
        return f"run with `{self.command}`{self.where}"

    def reason(self, why: str) -> str:
        """The skip reason of a test of this group: why, and what runs it."""
        return f"{self.label}: {why}; {self.run_with}"

    def owns(self, path: str, reason: str) -> bool:
        return reason.startswith(f"{self.label}: ") or bool(
            self.folder and path.startswith(self.folder))

    def why(self, reason: str) -> str:
        """What `reason` (one of this group's skips) says beyond the group."""
        why = reason.removeprefix(f"{self.label}: ")
        return why.split(f"; {self.run_with}")[0]


REDIS = Group("second tier on Redis", "make redis test")
MOONCAKE = Group("second tier on Mooncake", "make mooncake-deps test")
DOCKER = Group("Docker", "make docker-test", "tests/docker/")
GPU = Group("GPU", "make gpu-test", "tests/gpu/", " on a CUDA host")
VLLM = Group("vLLM", "make test-vllm", "tests/vllm/")
# What only the latest vLLM has (a wheel without a CPU build: its connector suites).
VLLM_LATEST = Group("vLLM 0.34", "make test-vllm-latest")
GROUPS = (REDIS, MOONCAKE, DOCKER, GPU, VLLM_LATEST, VLLM)


def redis_missing() -> str | None:
    """The skip reason of Redis tests here, or None when they can run."""
    return None if redis_servers.available() else REDIS.reason("redis-server is not installed")


@functools.lru_cache(maxsize=1)
def mooncake_missing() -> str | None:
    """The skip reason of Mooncake tests here, or None when they can run."""
    why = mooncake_servers.skip_reason()
    return None if why is None else MOONCAKE.reason(why)


# Mooncake tests skip when they cannot run here, unless EC_MOONCAKE_REQUIRED=1
# (.ci/run sets it): then that is a failure.
MOONCAKE_REQUIRED = os.environ.get("EC_MOONCAKE_REQUIRED", "") not in ("", "0")

needs_redis = pytest.mark.skipif(redis_missing() is not None, reason=redis_missing() or "")


def check_mooncake() -> None:
    """Skip (or, with EC_MOONCAKE_REQUIRED, fail) when Mooncake cannot run."""
    missing = mooncake_missing()
    if missing and MOONCAKE_REQUIRED:
        pytest.fail(f"Mooncake tests required (EC_MOONCAKE_REQUIRED) but cannot run: "
                    f"{missing}", pytrace=False)
    if missing:
        pytest.skip(missing)


def not_run(skips: Iterable[tuple[str, str, bool]]) -> str:
    """One line naming each group that did not run, why and what runs it,
    from (node id, reason, whether a whole file or folder was skipped) of
    each skip; "" when no group's test was skipped."""
    tests: dict[Group, int] = {}
    collections: dict[Group, list[str]] = {}
    whys: dict[Group, dict[str, None]] = {}
    for path, reason, whole in skips:
        group = next((g for g in GROUPS if g.owns(path, reason)), None)
        if group is None:
            continue
        if whole:
            collections.setdefault(group, []).append(path)
        else:
            tests[group] = tests.get(group, 0) + 1
        whys.setdefault(group, {})[group.why(reason)] = None
    parts = []
    for group in GROUPS:
        if group not in whys:
            continue
        n = tests.get(group, 0)
        what = [*collections.get(group, []), *([f"{n} test{'s' if n > 1 else ''}"] if n else [])]
        parts.append(f"{group.label} ({' and '.join(what)} skipped: "
                     f"{'; '.join(whys[group])}; {group.run_with})")
    return "not run here: " + " | ".join(parts) if parts else ""
