"""The namespace of an engine's cache keys, from its vLLM config.

The namespace is the layout fingerprint every process of an engine computes
alike at construction (`layout_of`): model, revision, dtype, quantization, the LM
embedding row width, `ec_daemon_namespace`, the identity of the weights
(`w=`: `ec_client.identity`, or `ec_daemon_weights_id`; with the tensorizer
loader, its file's too), so a checkpoint replaced under the same path or a
switched symlink gets a namespace of its own, a digest of the encoder
settings that change an image's encoder output (`mm=`: `encoder_config_of`,
an FP8 scale file by content), and the vLLM and transformers versions
(`rt=`), so a cache that outlives an upgrade serves nothing the new code
would not compute. vLLM measures encoder output widths only
in producers and only after the workers' connectors exist, so they cannot be
part of a key a consumer must match; each entry carries its own shape
instead, and the loads restore it.

Beside `ec_client.identity`, which names the weights from their files and
knows nothing of vLLM: this module reads vLLM's config (every field it reads
is listed in `ec_client.vllm_names`) and builds the layout and, for a
Mooncake store shared with vLLM's own connector, the store namespace.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import torch

from ec_client.common.limits import MAX_RUNTIME_CHARS
from ec_client.common.settings import ConnectorSettings
from ec_client.identity import (
    UNKNOWN,
    encoder_digest,
    file_digest,
    hub_caches,
    runtime_versions,
    source_identity,
    weights_identity,
)
from ec_client.vllm_names import multimodal_config_hash
from ec_protocol.protocol import Layout, store_namespace_problem

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def engine_identity(vllm_config: VllmConfig) -> str:
    """Shared by an engine's EngineCore and its workers (same config)."""
    ec = vllm_config.ec_transfer_config
    base = (ec.engine_id if ec is not None and ec.engine_id else "") or vllm_config.instance_id
    return f"{base}_dp{vllm_config.parallel_config.data_parallel_index}"


def layout_of(vllm_config: VllmConfig, namespace: str = "", weights_id: str = "",
              settings: ConnectorSettings | None = None) -> Layout:
    """The layout fingerprint; `weights_id` overrides the weights' identity
    read from the model's files (`ec_client.identity`). With `settings`, its
    store namespace too (`store_namespace`)."""
    model = vllm_config.model_config
    dtype = str(model.dtype).removeprefix("torch.")
    element = torch.empty(0, dtype=model.dtype).element_size()
    width = int(model.get_inputs_embeds_size()) * element
    weights = weights_identity(str(model.model_weights or model.model), model.revision,
                               override=weights_id, cache_dirs=_hub_caches(vllm_config))
    source = tensorizer_source(vllm_config)
    if source and not weights_id:  # (the weights are read from there, not the model's files)
        loaded = source_identity(source)
        weights = UNKNOWN if UNKNOWN in (weights, loaded) else f"{weights}+{loaded}"
    if weights == UNKNOWN:  # never shared with an engine that may hold other weights
        weights = f"{UNKNOWN}-{engine_identity(vllm_config)}"
    encoder = encoder_digest(encoder_config_of(vllm_config))
    runtime = runtime_versions()
    if len(runtime) > MAX_RUNTIME_CHARS:  # (the daemon takes a variant of 256 characters)
        runtime = encoder_digest(runtime)
    variant = "|".join(str(v) for v in (model.revision or "", model.quantization or "",
                                        namespace, f"w={weights}", f"mm={encoder}",
                                        f"rt={runtime}") if v)
    shared = store_namespace(vllm_config, weights, variant, settings) if settings is not None \
        else ""
    return Layout(model=str(model.model), dtype=dtype, row_bytes={"embeds": width},
                  variant=variant, store_namespace=shared)


# vLLM's key scheme for encoder outputs in Mooncake Store (its
# mooncake_store_embedding.data.EMBEDDING_CACHE_KEY_VERSION): the value format
# ec_daemon.remote.mooncake reads and writes.
STORE_KEY_VERSION = "v3"
# What of a model's path or hub id stays as it is in ec-daemon's own model
# name in store keys; the rest is %-escaped (whitespace, non-ASCII, "@", "#"
# and "%" among them), so the name never holds "@id:" nor our "#weights=".
MODEL_NAME_SAFE = "/:._-~+=,"


def store_namespace(vllm_config: VllmConfig, weights: str, variant: str,
                    settings: ConnectorSettings) -> str:
    """The engine's namespace in a Mooncake store shared with vLLM's own
    connector, built as vLLM's `build_embedding_namespace` builds it: model
    identity, revision, the multimodal config's hash, dtype, key version.

    vLLM names the model by `embedding_model_identity`, else its path or hub
    id, which is neither the weights nor the rest of what ec-daemon's local
    layout tells apart (`variant`: quantization, `ec_daemon_namespace`,
    processor and media options, config overrides, code, loader;
    `encoder_config_of`). Unless `embedding_model_identity` is set, ec-daemon
    names the model as `<model>#weights=<weights>#layout=<digest of variant>`,
    so two deployments share store keys exactly when they share a local
    layout (such keys are never vLLM's; the model's path is %-escaped in
    them, as the daemon takes printable ASCII only). With
    `embedding_model_identity` set the keys are vLLM's: the operator vouches
    that every engine sharing the identity encodes alike.

    Raises ValueError for a namespace the daemon would refuse at every
    attach (`store_namespace_problem`)."""
    model = vllm_config.model_config
    mm = model.multimodal_config
    encoder_hash = multimodal_config_hash(mm) if mm is not None else "encoder:default"
    identity = settings.store_model_identity or (
        f"{quote(str(model.model), safe=MODEL_NAME_SAFE)}#weights={weights}"
        f"#layout={layout_digest(variant)}")
    prefix = f"{settings.store_prefix}@" if settings.store_prefix else ""
    namespace = (f"{prefix}embedding@model:{identity}@revision:{model.revision or 'default'}"
                 f"@encoder:{encoder_hash}@dtype:{model.dtype}@protocol:{STORE_KEY_VERSION}")
    problem = store_namespace_problem(namespace)
    if problem is not None:
        raise ValueError(f"the Mooncake store namespace built from embedding_model_identity, "
                         f"embedding_cache_prefix and the model's revision "
                         f"({namespace[:200]!r}) would be refused by ec-daemon: {problem}")
    return namespace


def layout_digest(variant: str) -> str:
    """A short, stable digest of a layout variant (16 hex digits)."""
    return hashlib.sha256(variant.encode()).hexdigest()[:16]


def encoder_config_of(vllm_config: VllmConfig) -> str:
    """What, besides the weights, changes the encoder output of the same
    image: vLLM's hash of the encoder settings (attention backend and dtype,
    TP mode, device-side normalisation), the processor and media options,
    overrides of the model's config, and its code; as stable text."""
    model = vllm_config.model_config
    mm = model.multimodal_config
    overrides = model.hf_overrides
    # "device" only places the processor: vLLM adds it to encode-only
    # producers, which must share a namespace with their consumers.
    processor = {k: v for k, v in ((mm.mm_processor_kwargs if mm is not None else None)
                                   or {}).items() if k != "device"}
    factors = {
        "encoder": multimodal_config_hash(mm) if mm is not None else "",
        "mm_processor_kwargs": processor,
        "media_io_kwargs": (mm.media_io_kwargs if mm is not None else None) or {},
        # A callable is named by its qualified name: its repr holds an address.
        "hf_overrides": (f"{overrides.__module__}.{overrides.__qualname__}"
                         if callable(overrides) else overrides or {}),
        "hf_config_path": model.hf_config_path or "",
        "code_revision": model.code_revision or "",
        "model_impl": str(model.model_impl),
        # Weights from somewhere other than the model's files (dummy weights,
        # a tensorizer URI in the loader's config): the loader says which.
        "load_format": str(vllm_config.load_config.load_format),
        "model_loader_extra_config": vllm_config.load_config.model_loader_extra_config or {},
        # vLLM hashes this file's path (`encoder`): its content counts too.
        "fp8_scales": file_digest(scales) if (scales := getattr(
            mm, "mm_encoder_fp8_scale_path", None)) else "",
    }
    return json.dumps(factors, sort_keys=True, default=str)


def tensorizer_source(vllm_config: VllmConfig) -> str:
    """Where vLLM's tensorizer loader reads the weights from (its
    tensorizer_uri, else tensorizer_dir), or "" for any other loader."""
    load = vllm_config.load_config
    if str(load.load_format).rsplit(".", 1)[-1].lower() != "tensorizer":
        return ""
    extra: Any = load.model_loader_extra_config or {}
    if isinstance(extra, dict):  # ({"tensorizer_config": {...}}), else a TensorizerConfig
        extra = extra.get("tensorizer_config") or {}

    def field_of(name: str) -> Any:
        return extra.get(name) if isinstance(extra, dict) else getattr(extra, name, None)

    return str(field_of("tensorizer_uri") or field_of("tensorizer_dir") or "")


def _hub_caches(vllm_config: VllmConfig) -> list[str]:
    """Where vLLM keeps hub models: its --download-dir, then the HF cache."""
    download_dir = vllm_config.load_config.download_dir
    return [download_dir, *hub_caches()] if download_dir else hub_caches()
