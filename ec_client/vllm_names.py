"""Every vLLM name ec_client uses, listed once, and the check of a release.

The vLLM connector (`vllm_connector` and its two halves, `vllm_metadata`,
`vllm_engine`, `vllm_namespace`, `vllm_items`, `vllm_metrics`, `vllm_plugin`)
reaches into vLLM well beyond `ECConnectorBase`: config fields it builds its
namespace from, vLLM's helpers for `ec_transfer_params`,
its metrics base classes, its executor and process groups. A release that
renames any of them breaks the connector at construction or on the first
request (vLLM 0.34 removed `MultiModalConfig.compute_hash`), and a test of
the base class's signatures alone does not notice. `USES` names each one
with how ec_client uses it; `problems` checks them against the installed
vLLM, cheaply (imports and signatures, no engine). The vLLM suites run it
on every tested release (tests/vllm/test_vllm_names.py) and `make
vllm-compat VLLM=<version>` on a new one.

`Use.name` is `module:Qualified.name`. The last part may be a class
attribute, a method, a dataclass or pydantic field, or an attribute a class
assigns to `self` in its source (vLLM's `Request`). `call` is how ec_client
calls it: parameter names, `name=` for a keyword (checked by binding them
to its signature). `alternatives` are other names that serve instead where
a release has them (the connector chooses at run time, as
`multimodal_config_hash` does); `optional` marks a name read with a default
(`getattr`), whose absence changes nothing.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

BASE = "vllm.distributed.ec_transfer.ec_connector.base"
UTILS = "vllm.distributed.ec_transfer.ec_connector.utils"
METRICS = "vllm.distributed.ec_transfer.ec_connector.metrics"
FACTORY = "vllm.distributed.ec_transfer.ec_connector.factory"
INPUTS = "vllm.multimodal.inputs"


@dataclass(frozen=True)
class Use:
    name: str  # "module:Qualified.name"
    where: str  # what of ec_client uses it
    call: tuple[str, ...] | None = None  # the arguments it is called with
    alternatives: tuple[Use, ...] = ()
    optional: bool = False


def _fields(owner: str, names: str, where: str) -> list[Use]:
    return [Use(f"{owner}.{name}", where) for name in names.split()]


USES: tuple[Use, ...] = (
    # The connector's base classes (vllm_connector, vllm_metadata).
    Use(f"{BASE}:ECConnectorBase", "ECDaemonConnector's base class"),
    Use(f"{BASE}:ECConnectorBase.__init__", "ECDaemonConnector.__init__",
        call=("self", "vllm_config=", "role=")),
    Use(f"{BASE}:ECConnectorBase.bind_connector_metadata", "bind_connector_metadata",
        call=("self", "connector_metadata")),
    Use(f"{BASE}:ECConnectorBase.clear_connector_metadata", "clear_connector_metadata",
        call=("self",)),
    Use(f"{BASE}:ECConnectorBase._get_connector_metadata", "start_load_caches",
        call=("self",)),
    *_fields(f"{BASE}:ECConnectorBase", "is_producer is_consumer",
             "the role's halves (WorkerRole.save, SchedulerRole.request_finished)"),
    Use(f"{BASE}:ECConnectorMetadata", "ECDaemonConnectorMetadata's base class"),
    Use(f"{BASE}:ECConnectorWorkerMetadata", "ECDaemonWorkerMetadata's base class"),
    *_fields(f"{BASE}:ECConnectorRole", "SCHEDULER WORKER", "the role routing"),
    Use("vllm.logger:init_logger", "the connector's logger", call=("name",)),
    # The config the layout and the engine's identity are built from.
    *_fields("vllm.config:VllmConfig", "ec_transfer_config instance_id parallel_config "
             "model_config load_config lora_config device_config", "layout_of, the roles"),
    *_fields("vllm.config:ECTransferConfig", "engine_id ec_role ec_connector_extra_config",
             "engine_identity, the settings"),
    *_fields("vllm.config:ParallelConfig", "data_parallel_index tensor_parallel_size "
             "distributed_executor_backend", "engine_identity, expected_reports"),
    Use("vllm.config:ParallelConfig.prefill_context_parallel_size", "expected_reports",
        optional=True),
    *_fields("vllm.config:ModelConfig", "dtype model_weights model revision quantization "
             "multimodal_config hf_overrides hf_config_path code_revision model_impl",
             "layout_of, encoder_config_of, store_namespace"),
    Use("vllm.config:ModelConfig.get_inputs_embeds_size", "layout_of (the row width)",
        call=("self",)),
    Use("vllm.config:MultiModalConfig.compile_factors", "multimodal_config_hash",
        call=("self",), alternatives=(
            Use("vllm.config:MultiModalConfig.compute_hash", "multimodal_config_hash (< 0.34)",
                call=("self",)),)),
    Use("vllm.config.utils:hash_config", "multimodal_config_hash", call=("config",),
        alternatives=(Use("vllm.config:MultiModalConfig.compute_hash",
                          "multimodal_config_hash (< 0.34)", call=("self",)),)),
    *_fields("vllm.config:MultiModalConfig", "mm_processor_kwargs media_io_kwargs",
             "encoder_config_of"),
    Use("vllm.config:MultiModalConfig.mm_encoder_fp8_scale_path", "encoder_config_of",
        optional=True),
    *_fields("vllm.config:LoadConfig", "load_format model_loader_extra_config download_dir",
             "encoder_config_of, tensorizer_source, the weights' identity"),
    Use("vllm.config:LoRAConfig.enable_tower_connector_lora", "items an adapter encodes",
        optional=True),
    Use("vllm.config:DeviceConfig.device_type", "check_backend_device (WorkerRole)"),
    # Absent from 0.34, whose workers all run Model Runner V2.
    Use("vllm.config:VllmConfig.use_v2_model_runner", "workers_run_idle_steps", optional=True),
    # What vLLM's scheduler and workers hand the connector.
    *_fields("vllm.v1.core.sched.output:SchedulerOutput",
             "free_encoder_mm_hashes num_scheduled_tokens total_num_scheduled_tokens",
             "build_connector_meta"),
    Use("vllm.v1.outputs:ECConnectorOutput.ec_connector_worker_meta",
        "update_connector_output"),
    *_fields("vllm.v1.request:Request", "request_id mm_features ec_transfer_params",
             "ensure_cache_available, request_finished, RequestItems"),
    *_fields(f"{INPUTS}:MultiModalFeatureSpec", "identifier mm_position modality data",
             "ensure_cache_available, RequestItems"),
    *_fields(f"{INPUTS}:PlaceholderRange", "offset length", "ensure_cache_available"),
    Use(f"{INPUTS}:MultiModalKwargsItem.items", "RequestItems.metadata_only", call=("self",)),
    Use(f"{INPUTS}:MultiModalFieldElem.data", "RequestItems.metadata_only"),
    # The executor and the process groups (how many ranks report a load).
    Use("vllm.v1.executor.abstract:Executor.get_class", "_aggregates_every_rank",
        call=("vllm_config",)),
    Use("vllm.v1.executor.multiproc_executor:MultiprocExecutor", "_aggregates_every_rank"),
    Use("vllm.distributed.parallel_state:get_tp_group", "loading_rank_of", call=()),
    Use("vllm.distributed.parallel_state:get_pcp_group", "loading_rank_of", call=()),
    Use("vllm.distributed.parallel_state:GroupCoordinator.rank_in_group", "loading_rank_of"),
    # ec_transfer_params (vllm_items).
    Use(f"{UTILS}:PlaceholderMetadataResolver", "RequestItems.resolver",
        call=("model_config",)),
    Use(f"{UTILS}:PlaceholderMetadataResolver.fields_for", "RequestItems.metadata_only",
        call=("self", "modality")),
    Use(f"{UTILS}:collect_ec_item_metadata", "RequestItems.transfer_params",
        call=("mm_features", "resolver")),
    # Stats and /metrics (vllm_metrics).
    Use(f"{METRICS}:ECConnectorStats", "ECDaemonStats's base class", call=("data=",)),
    Use(f"{METRICS}:ECConnectorStats.data", "ECDaemonStats"),
    Use(f"{METRICS}:ECConnectorPromMetrics.__init__", "ECDaemonPromMetrics",
        call=("self", "vllm_config", "metric_types", "labelnames", "per_engine_labelvalues")),
    *_fields(f"{METRICS}:ECConnectorPromMetrics",
             "_counter_cls _histogram_cls _gauge_cls per_engine_labelvalues",
             "ECDaemonPromMetrics"),
    # vLLM keeps an idle engine stepping while this says so: how the attached
    # gauge reaches /metrics without a request.
    Use(f"{BASE}:ECConnectorBase.has_pending_push_work", "has_pending_push_work",
        call=("self",)),
    # The plugin (vllm_plugin).
    Use(f"{FACTORY}:ECConnectorFactory.register_connector", "vllm_plugin.register",
        call=("name", "module_path", "class_name")),
    Use(f"{FACTORY}:ECConnectorFactory._registry", "vllm_plugin.register"),
)


def multimodal_config_hash(multimodal_config: Any) -> str:
    """vLLM's hash of the encoder settings, as its Mooncake embedding
    namespace names the encoder: `hash_config` of the config's
    `compile_factors` where vLLM has them (0.34), else its `compute_hash`
    (0.32, 0.33). Used for the local layout and the store namespace alike."""
    if hasattr(multimodal_config, "compile_factors"):
        from vllm.config.utils import hash_config

        return str(hash_config(multimodal_config))
    return str(multimodal_config.compute_hash())


def problems(uses: tuple[Use, ...] = USES) -> list[str]:
    """What of `uses` the installed vLLM lacks or would refuse, one line
    each (empty: every name is there and takes ec_client's arguments)."""
    found = []
    for use in uses:
        problem = _problem(use)
        if problem is None or use.optional:
            continue
        for alternative in use.alternatives:
            if _problem(alternative) is None:
                break
        else:
            also = "".join(f"; instead {a.name}: {_problem(a)}" for a in use.alternatives)
            found.append(f"{use.name} ({use.where}): {problem}{also}")
    return found


def _problem(use: Use) -> str | None:
    module_name, _, qualname = use.name.partition(":")
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError as error:
        return f"no module {module_name} ({error})"
    *path, last = qualname.split(".")
    for part in path:
        if not hasattr(owner, part):
            return f"{module_name} has no {part}"
        owner = getattr(owner, part)
    if hasattr(owner, last):
        value = getattr(owner, last)
    elif inspect.isclass(owner) and _instance_attribute(owner, last):
        value = None
    else:
        return f"{getattr(owner, '__name__', owner)} has no {last}"
    if use.call is None:
        return None
    return _refused(owner, last, value, use.call)


def _instance_attribute(cls: type, name: str) -> bool:
    """A field of a (pydantic) dataclass, an annotation, or `self.name =`
    in the source of the class or a base."""
    for klass in cls.__mro__:
        if name in getattr(klass, "__dataclass_fields__", {}) or name in getattr(
                klass, "model_fields", {}) or name in vars(klass).get("__annotations__", {}):
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if f"self.{name} =" in source or f"self.{name}:" in source:
            return True
    return False


def _refused(owner: Any, name: str, value: Any, call: tuple[str, ...]) -> str | None:
    """Why vLLM's `owner.name` would refuse ec_client's arguments, or None."""
    if value is None or not callable(value):
        return "not callable"
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):
        return None  # (a builtin without a signature: nothing to check)
    if inspect.isclass(owner) and call[:1] == ("self",) and not isinstance(
            inspect.getattr_static(owner, name), (classmethod, staticmethod)):
        pass  # an unbound method: `self` is its first parameter
    elif call[:1] == ("self",):
        call = call[1:]
    positional = [object() for arg in call if not arg.endswith("=")]
    keywords = {arg[:-1]: object() for arg in call if arg.endswith("=")}
    try:
        signature.bind(*positional, **keywords)
    except TypeError as error:
        return f"refuses ({', '.join(call)}): {error}; its signature is {signature}"
    return None
