"""ec-daemon's namespace in a Mooncake store is vLLM's own
(`build_embedding_namespace`, the namespace vLLM's Mooncake embedding store
connector writes under) for the same config where the operator names the
model (`embedding_model_identity`), and ec-daemon's own otherwise: checked
against vLLM's code on a real VllmConfig, on every tested release (vLLM 0.34
names the encoder by `hash_config` of its multimodal config's
`compile_factors`, 0.32 and 0.33 by its `compute_hash`). Keys only, no store:
tests/vllm/test_mooncake_interop.py shares values with vLLM's store client."""

from __future__ import annotations

import re
from typing import Any

import pytest
from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.data import (
    build_embedding_namespace,
)

from ec_client.common.settings import ConnectorSettings
from ec_client.identity import files_identity
from ec_client.vllm_namespace import layout_of
from ec_protocol.protocol import store_namespace_problem
from tests.vllm import vllm_harness as h

NOWHERE = h.NOWHERE
IDENTITY = h.STORE_IDENTITY



def store_namespace(config: Any) -> str:
    """The store namespace ec-daemon's connector sends for `config` (as the
    connector builds its layout)."""
    settings = ConnectorSettings.from_extra_config(config.ec_transfer_config
                                                   .ec_connector_extra_config)
    return layout_of(config, settings.namespace, settings.weights_id, settings).store_namespace


# ---------------------------------------------------------------- keys


@pytest.mark.parametrize("extra", [IDENTITY, {**IDENTITY, "embedding_cache_prefix": "fleet-a"}],
                         ids=["identity", "identity+prefix"])
def test_with_a_model_identity_the_store_namespace_is_vllms(tiny_model, extra):
    config = h.make_config(tiny_model, NOWHERE, **extra)
    assert store_namespace(config) == build_embedding_namespace(config)
    # A producer and a consumer of one model share it, as in vLLM.
    consumer = h.make_config(tiny_model, NOWHERE, role="ec_consumer", **extra)
    assert store_namespace(consumer) == build_embedding_namespace(config)


def test_an_encoder_setting_vllm_hashes_moves_both_namespaces_alike(tiny_model):
    """The encoder's part is vLLM's hash of its multimodal config, whatever
    this release calls it (`multimodal_config_hash`)."""
    base = h.make_config(tiny_model, NOWHERE, **IDENTITY)
    assert "@encoder:encoder:default@" not in store_namespace(base)  # (a multimodal model)
    other = h.make_config(tiny_model, NOWHERE, **IDENTITY)
    other.model_config.multimodal_config.mm_encoder_tp_mode = "data"
    assert store_namespace(other) == build_embedding_namespace(other)
    assert store_namespace(other) != store_namespace(base)


@pytest.mark.parametrize("extra", [{}, {"embedding_cache_prefix": "fleet-a"}],
                         ids=["plain", "prefix"])
def test_without_a_model_identity_the_store_namespace_names_the_weights(tiny_model, extra):
    """vLLM names the model by its path, which is not the weights: ec-daemon
    adds their identity, and so shares keys only with engines on the same
    weights (other ec-daemon hosts), never with vLLM's connector."""
    config = h.make_config(tiny_model, NOWHERE, **extra)
    ours, theirs = store_namespace(config), build_embedding_namespace(config)
    assert ours != theirs
    weights = f"#weights={files_identity(str(tiny_model))}"
    assert weights in ours
    # ...and a digest of the whole local layout (`Layout.variant`): the name
    # vLLM gives the model, then ec-daemon's additions, then vLLM's rest.
    model = str(config.model_config.model)
    additions = re.fullmatch(rf".*@model:{re.escape(model)}(#weights=[^@]*)@.*", ours)
    assert additions is not None, ours
    assert re.fullmatch(rf"{re.escape(weights)}#layout=[0-9a-f]{{16}}", additions[1])
    assert ours.replace(additions[1], "", 1) == theirs


@pytest.mark.parametrize("name", ["/models/My Models/paligemma", "/models/模型/paligemma",
                                  "/models/a@id:b/paligemma", "/models/a#weights=x"])
def test_without_a_model_identity_any_model_path_makes_a_namespace_the_daemon_takes(tiny_model,
                                                                                    name):
    """The daemon takes printable ASCII without whitespace and without
    "@id:" (`store_namespace_problem`): ec-daemon's own model name escapes
    the path (these keys are never vLLM's), so every engine attaches."""
    config = h.make_config(tiny_model, NOWHERE)
    config.model_config.model = name
    ours = store_namespace(config)
    assert store_namespace_problem(ours) is None, ours
    other = h.make_config(tiny_model, NOWHERE)
    other.model_config.model = name.replace("paligemma", "paligemma2")
    assert store_namespace(other) != ours


@pytest.mark.parametrize(("extra", "refused"), [
    ({"embedding_model_identity": "tiny paligemma"}, "' ' at"),
    ({**IDENTITY, "embedding_cache_prefix": "fleet@id:a"}, "'@id:'"),
    ({**IDENTITY, "embedding_cache_prefix": "x" * 1024}, "longer than 1024"),
], ids=["space", "id-marker", "too-long"])
def test_a_store_namespace_the_daemon_would_refuse_stops_the_connector(tiny_model, extra,
                                                                       refused):
    """vLLM's keys are the operator's to choose; one the daemon would refuse
    at every attach is said at start, naming the keys."""
    config = h.make_config(tiny_model, NOWHERE, **extra)
    with pytest.raises(ValueError, match="embedding_model_identity") as info:
        store_namespace(config)
    assert refused in str(info.value)


# What changes the encoder output besides the weights, and is not in vLLM's
# namespace: ec-daemon keeps such deployments apart in its local layout
# (`layout_of`), and so in the store unless the operator vouches for the
# model's identity (`embedding_model_identity`).
def _hf_overrides(config: Any) -> None:
    config.model_config.hf_overrides = {"text_config": {"rope_theta": 20000.0}}


def _processor(config: Any) -> None:
    config.model_config.multimodal_config.mm_processor_kwargs = {"do_pan_and_scan": True}


def _quantization(config: Any) -> None:
    config.model_config.quantization = "fp8"


def _model_impl(config: Any) -> None:
    config.model_config.model_impl = "transformers"


DEPLOYMENT_CHANGES: dict[str, tuple[dict[str, str], Any]] = {
    "ec_daemon_namespace": ({"ec_daemon_namespace": "team-b"}, None),
    "hf_overrides": ({}, _hf_overrides),
    "mm_processor_kwargs": ({}, _processor),
    "quantization": ({}, _quantization),
    "model_impl": ({}, _model_impl),
}


@pytest.mark.parametrize("change", sorted(DEPLOYMENT_CHANGES))
def test_without_a_model_identity_deployments_apart_locally_are_apart_in_the_store(tiny_model,
                                                                                    change):
    extra, mutate = DEPLOYMENT_CHANGES[change]
    base = h.make_config(tiny_model, NOWHERE)
    other = h.make_config(tiny_model, NOWHERE, **extra)
    if mutate is not None:
        mutate(other)
    assert layout_of(base).variant != layout_of(other, extra.get("ec_daemon_namespace", "")).variant
    # vLLM's namespace is the same for both: ec-daemon's must not be.
    assert build_embedding_namespace(base) == build_embedding_namespace(other)
    assert store_namespace(base) != store_namespace(other)
    assert store_namespace(base) == store_namespace(h.make_config(tiny_model, NOWHERE))


@pytest.mark.parametrize("change", sorted(DEPLOYMENT_CHANGES))
def test_with_a_model_identity_the_operator_vouches_for_the_deployment(tiny_model, change):
    """vLLM's keys, exactly: what they do not name, the identity covers."""
    extra, mutate = DEPLOYMENT_CHANGES[change]
    base = h.make_config(tiny_model, NOWHERE, **IDENTITY)
    other = h.make_config(tiny_model, NOWHERE, **IDENTITY, **extra)
    if mutate is not None:
        mutate(other)
    assert store_namespace(base) == store_namespace(other) == build_embedding_namespace(other)
