"""What the connector reads of the vLLM engine it runs in, beyond its settings.

How many worker ranks load each hit and which one this process is (vLLM's
parallel config and process groups, `ec_client.ranks` doing the
arithmetic), how many of them report each load (the executor vLLM
resolves), whether the workers run the connector in a step without tokens
(the model runner), and the device a worker runs on. The connector's shell
reads the engine's layout here when it builds its role's half
(`ec_client.vllm_connector`); each answer is a plain value the halves and
the vLLM-free delegates take.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ec_client.ranks import LoadingRank, loading_rank, loading_world

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def workers_run_idle_steps(vllm_config: VllmConfig) -> bool:
    """Do this engine's workers run the EC connector in a step that schedules
    no tokens? Model Runner V2 does (`ActiveECConnector.no_forward`), the V1
    model runner does not (its `execute_model` returns before the connector's
    context). vLLM 0.34 has only V2; 0.32 and 0.33 choose per engine
    (`VllmConfig.use_v2_model_runner`: the environment, Triton, features),
    alike in the scheduler's process and its workers'."""
    chooses = getattr(type(vllm_config), "use_v2_model_runner", None)
    return chooses is None or bool(vllm_config.use_v2_model_runner)


def current_worker_device(device_type: str) -> str:
    """This worker's device: vLLM's worker makes its GPU current before it
    builds the connector, so on CUDA the current device names it."""
    if device_type != "cuda":
        return device_type
    import torch

    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else device_type


def expected_reports(vllm_config: VllmConfig) -> int:
    """How many worker ranks report each load: the tp x pcp ranks of pipeline
    stage 0 (only it runs the EC connector) under an executor that aggregates
    every rank's output (`_aggregates_every_rank`); other executors deliver
    one rank's output, and waiting for reports that cannot come would hold
    the entry until the backstop."""
    pc = vllm_config.parallel_config
    if not _aggregates_every_rank(vllm_config):
        return 1
    return int(pc.tensor_parallel_size) * int(getattr(pc, "prefill_context_parallel_size", 1))


def loading_world_of(vllm_config: VllmConfig) -> int:
    """The worker ranks that load each hit and must map the region: tp x pcp
    (`ec_client.ranks`)."""
    pc = vllm_config.parallel_config
    return loading_world(int(pc.tensor_parallel_size),
                         int(getattr(pc, "prefill_context_parallel_size", 1)))


def _aggregates_every_rank(vllm_config: VllmConfig) -> bool:
    """Does the engine's executor hand the scheduler every rank's EC output?
    vLLM's `MultiprocExecutor` does (its EC output aggregator), and so does
    any subclass: "ray" is `RayExecutorV2`, one of them, in vLLM 0.33 (and in
    0.32 unless VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0 picks the older
    `RayDistributedExecutor`, which is not). Decided by the class vLLM
    resolves, never by the backend's name."""
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    try:
        executor = Executor.get_class(vllm_config)
    except Exception:  # (Ray's executors without Ray): such an engine never runs.
        # Waiting for every rank is the safe side: a load counted done early
        # could have its pages reused under a rank still copying.
        return True
    return issubclass(executor, MultiprocExecutor)


def loading_rank_of(vllm_config: VllmConfig) -> LoadingRank:
    """This worker's rank among its engine's loading ranks (`ec_client.ranks`)."""
    pc = vllm_config.parallel_config
    tp, pcp = int(pc.tensor_parallel_size), int(getattr(pc, "prefill_context_parallel_size", 1))
    if tp * pcp == 1:
        return loading_rank(0, 1)
    from vllm.distributed.parallel_state import get_pcp_group, get_tp_group

    return loading_rank(int(get_tp_group().rank_in_group), tp,
                        int(get_pcp_group().rank_in_group) if pcp > 1 else 0, pcp)
