"""The vLLM names ec_client uses (`ec_client.vllm_names.USES`) are all in the
installed vLLM and take ec_client's arguments; every vLLM import of ec_client
is listed there. Run by every vLLM suite (0.32, 0.33, 0.34) and by `make
vllm-compat VLLM=<version>`; imports and signatures only, no daemon."""

from __future__ import annotations

import ast
from pathlib import Path

from ec_client import vllm_names
from ec_client.vllm_names import Use, problems

EC_CLIENT = Path(vllm_names.__file__).parent


def test_every_vllm_name_ec_client_uses_is_in_this_vllm():
    found = problems()
    assert found == [], "this vLLM lacks or refuses what ec_client uses:\n" + "\n".join(found)


def vllm_imports() -> set[str]:
    """`module:name` for every `from vllm... import name` in ec_client."""
    imported = set()
    for path in EC_CLIENT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names
                             if alias.name.split(".")[0] == "vllm"}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                imported |= {f"{node.module}:{alias.name}" for alias in node.names}
    return imported


def test_every_vllm_import_of_ec_client_is_listed():
    imported = vllm_imports()
    assert "vllm.distributed.ec_transfer.ec_connector.base:ECConnectorBase" in imported
    listed = [use.name for use in vllm_names.USES]
    listed += [alt.name for use in vllm_names.USES for alt in use.alternatives]
    unlisted = sorted(name for name in imported
                      if not any(n == name or n.startswith(f"{name}.") for n in listed))
    assert unlisted == [], f"add these to ec_client.vllm_names.USES: {unlisted}"


def test_the_check_names_what_is_missing_or_refused_and_takes_an_alternative():
    missing = Use("vllm.config:MultiModalConfig.no_such_method", "a test", call=("self",))
    (line,) = problems((missing,))
    assert line.startswith("vllm.config:MultiModalConfig.no_such_method (a test): ")
    assert "has no no_such_method" in line
    assert problems((Use("vllm.no_such_module:X", "a test"),))[0].count("no module") == 1
    refused = Use("vllm.distributed.ec_transfer.ec_connector.utils:collect_ec_item_metadata",
                  "a test", call=("mm_features", "resolver", "unexpected"))
    assert "refuses (mm_features, resolver, unexpected)" in problems((refused,))[0]
    keyword = Use("vllm.config:ModelConfig.get_inputs_embeds_size", "a test",
                  call=("self", "no_such_keyword="))
    assert "refuses" in problems((keyword,))[0]
    # An alternative that is there serves; an optional name is never a problem.
    served = Use(missing.name, "a test", alternatives=(Use("vllm.config:ModelConfig.dtype",
                                                           "a test"),))
    assert problems((served,)) == []
    assert problems((Use(missing.name, "a test", optional=True),)) == []
    # Instance attributes count: vLLM's Request assigns its fields in __init__.
    assert problems((Use("vllm.v1.request:Request.mm_features", "a test"),
                     Use("vllm.v1.request:Request.no_such_field", "a test")))[0].startswith(
        "vllm.v1.request:Request.no_such_field")
