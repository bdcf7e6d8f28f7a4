"""A copy backend whose loads fail when told to, as a backend's may for
reasons of its own (device memory, a driver error): the `cpu` backend,
except that while `FailingLoadBackend.fail_next` is above 0 each load is
refused (ValueError, as `CopyBackend.load_all` reports a refused load) and
counts it down. Selected by name through the connector's extra config:
`"ec_daemon_copy_backend": "tests.vllm.failing_copy:FailingLoadBackend"`;
the test sets the class attribute in its own process.
"""

from __future__ import annotations

from collections.abc import Sequence

from ec_client.copy import Load
from ec_client.copy.cpu_backend import Backend


class FailingLoadBackend(Backend):
    name = "failing-cpu"
    fail_next = 0  # loads to refuse, in the order a step queues them

    def load_all(self, loads: Sequence[Load]) -> list[Exception | None]:
        failing = []
        for _ in loads:
            failing.append(FailingLoadBackend.fail_next > 0)
            FailingLoadBackend.fail_next = max(0, FailingLoadBackend.fail_next - 1)
        errors = super().load_all([load for load, fail in zip(loads, failing, strict=True)
                                   if not fail])
        return [ValueError("the device refused the copy") if fail else errors.pop(0)
                for fail in failing]
