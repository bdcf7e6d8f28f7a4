"""vLLM's EC connector interface as ECDaemonConnector was written against it.

Fails when the installed vLLM changes what the connector implements or relies
on: `ECConnectorBase` gains (or loses) an abstract method, or the signature of
a hook below changes. Each failure is a review: read vLLM's change, adapt the
connector, then update the lists here. Checked in CI against every supported
vLLM release (`make test-vllm`, `make test-vllm-next`); imports only, no daemon.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
from vllm.distributed.ec_transfer.ec_connector import utils
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorWorkerMetadata,
)
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.executor.abstract import Executor

from ec_client.vllm_connector import ECDaemonConnector

POS = "POSITIONAL_OR_KEYWORD"
KW = "VAR_KEYWORD"

ABSTRACT = {"start_load_caches", "save_caches", "has_cache_item", "update_state_after_alloc",
            "build_connector_meta"}

# Hooks the connector implements: vLLM's parameters (name, kind), self first.
IMPLEMENTED: dict[str, tuple[tuple[str, str], ...]] = {
    "__init__": (("self", POS), ("vllm_config", POS), ("role", POS)),
    "shutdown": (("self", POS),),
    "bind_connector_metadata": (("self", POS), ("connector_metadata", POS)),
    "clear_connector_metadata": (("self", POS),),
    "start_load_caches": (("self", POS), ("encoder_cache", POS), ("kwargs", KW)),
    "save_caches": (("self", POS), ("encoder_cache", POS), ("mm_hash", POS), ("kwargs", KW)),
    "build_connector_worker_meta": (("self", POS),),
    "get_ec_connector_stats": (("self", POS),),
    "has_cache_item": (("self", POS), ("identifier", POS)),
    "ensure_cache_available": (("self", POS), ("request", POS), ("num_computed_tokens", POS)),
    "take_unavailable_requests": (("self", POS),),
    "update_state_after_alloc": (("self", POS), ("request", POS), ("index", POS)),
    "build_connector_meta": (("self", POS), ("scheduler_output", POS)),
    "update_connector_output": (("self", POS), ("connector_output", POS)),
    "request_finished": (("self", POS), ("request", POS)),
    "build_ec_connector_stats": (("cls", POS), ("data", POS)),
    "build_prom_metrics": (("cls", POS), ("vllm_config", POS), ("metric_types", POS),
                           ("labelnames", POS), ("per_engine_labelvalues", POS)),
    # (keeps an idle engine stepping until vLLM heard vllm:ec_daemon_attached)
    "has_pending_push_work": (("self", POS),),
}

# Hooks whose default the connector relies on (it has nothing to do there):
# no asynchronous sends (get_finished), nothing pushed (start_save_caches),
# no services, frees seen through
# SchedulerOutput.free_encoder_mm_hashes instead (update_state_after_free).
DEFAULTS: dict[str, tuple[tuple[str, str], ...]] = {
    "_get_connector_metadata": (("self", POS),),
    "register_caches": (("self", POS), ("ec_caches", POS)),
    "get_finished": (("self", POS), ("finished_req_ids", POS)),
    "start_save_caches": (("self", POS), ("kwargs", KW)),
    "start_worker_services": (("self", POS),),
    "update_state_after_free": (("self", POS), ("request", POS), ("index", POS)),
}


def params(function: Callable[..., Any]) -> tuple[tuple[str, str], ...]:
    return tuple((p.name, p.kind.name) for p in inspect.signature(function).parameters.values())


def base_hook(name: str) -> Callable[..., Any]:
    hook = ECConnectorBase.__dict__.get(name)
    assert hook is not None, f"vLLM's ECConnectorBase no longer has {name}"
    return getattr(hook, "__func__", hook)


def test_the_abstract_methods_are_the_reviewed_ones():
    assert set(ECConnectorBase.__abstractmethods__) == ABSTRACT
    assert set(ECConnectorWorkerMetadata.__abstractmethods__) == {"aggregate"}
    assert not getattr(ECDaemonConnector, "__abstractmethods__", None)


def test_every_hook_of_vllms_base_is_reviewed():
    hooks = {name for name, value in ECConnectorBase.__dict__.items()
             if callable(getattr(value, "__func__", value)) and not isinstance(value, type)
             and (not name.startswith("__") or name == "__init__")}
    assert hooks == set(IMPLEMENTED) | set(DEFAULTS)


@pytest.mark.parametrize("name", sorted(IMPLEMENTED))
def test_an_implemented_hook_keeps_vllms_signature(name):
    assert params(base_hook(name)) == IMPLEMENTED[name]
    assert name in ECDaemonConnector.__dict__, f"ECDaemonConnector no longer implements {name}"
    ours = ECDaemonConnector.__dict__[name]
    assert params(getattr(ours, "__func__", ours)) == IMPLEMENTED[name]


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_a_default_relied_on_keeps_its_signature_and_is_not_overridden(name):
    assert params(base_hook(name)) == DEFAULTS[name]
    assert name not in ECDaemonConnector.__dict__


def test_what_else_the_connector_relies_on_is_there():
    assert "free_encoder_mm_hashes" in SchedulerOutput.__dataclass_fields__
    assert params(utils.collect_ec_item_metadata) == (("mm_features", POS), ("resolver", POS))
    assert params(utils.PlaceholderMetadataResolver.fields_for) == (("self", POS),
                                                                    ("modality", POS))
    assert params(ECConnectorFactory.register_connector.__func__) == (
        ("cls", POS), ("name", POS), ("module_path", POS), ("class_name", POS))
    assert isinstance(ECConnectorFactory._registry, dict)  # (vllm_plugin reads it)
    assert params(Executor.get_class) == (("vllm_config", POS),)
