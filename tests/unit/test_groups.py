"""The last line of a test run (tests/groups.py): each group that did not
run, how much of it, why, and the command that runs it; nothing else."""

from __future__ import annotations

from tests import groups
from tests.groups import DOCKER, MOONCAKE, REDIS, VLLM


def test_the_line_names_each_skipped_group_with_its_reason_and_command() -> None:
    redis = REDIS.reason("redis-server is not installed")
    line = groups.not_run([
        ("tests/remote/test_store.py::test_a", redis, False),
        ("tests/integration/test_second_tier.py::test_b", redis, False),
        ("tests/remote/test_mooncake.py::test_c",
         MOONCAKE.reason("mooncake.store does not import: libibverbs.so.1"), False),
        ("tests/docker/test_containers.py::test_d", DOCKER.reason("no Docker engine"), False),
        # GPU's files word their own reasons: known by their folder.
        ("tests/gpu/test_gpu_backends.py", "CUDA is not available", True),
        ("tests/vllm", VLLM.reason("vLLM is not installed in this venv"), True),
        # Not a group: a skip of its own, left to pytest's -ra lines.
        ("tests/unit/test_trust.py::test_e", "giving a file away needs root", False),
    ])
    assert line == (
        "not run here: second tier on Redis (2 tests skipped: redis-server is not installed; "
        "run with `make redis test`) | second tier on Mooncake (1 test skipped: mooncake.store "
        "does not import: libibverbs.so.1; run with `make mooncake-deps test`) | Docker (1 test "
        "skipped: no Docker engine; run with `make docker-test`) | GPU "
        "(tests/gpu/test_gpu_backends.py skipped: CUDA is not available; run with "
        "`make gpu-test` on a CUDA host) | vLLM (tests/vllm skipped: vLLM is not installed in "
        "this venv; run with `make test-vllm`)")


def test_nothing_is_said_when_every_group_ran() -> None:
    assert groups.not_run([("tests/unit/test_trust.py::test_e", "needs root", False)]) == ""
    assert groups.not_run([]) == ""


def test_a_group_skipped_for_two_reasons_says_both_once() -> None:
    line = groups.not_run([
        ("tests/remote/test_mooncake.py::a", MOONCAKE.reason("mooncake_master is not installed"),
         False),
        ("tests/remote/test_mooncake.py::b", MOONCAKE.reason("mooncake_master is not installed"),
         False),
        ("tests/vllm/test_two_hosts.py::c", MOONCAKE.reason("import mooncake.store took over 60 s"),
         False),
    ])
    assert line == ("not run here: second tier on Mooncake (3 tests skipped: mooncake_master is "
                    "not installed; import mooncake.store took over 60 s; run with "
                    "`make mooncake-deps test`)")
