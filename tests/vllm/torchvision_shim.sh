#!/usr/bin/env bash
# torchvision_shim.sh DEST
#
# Install a pure-Python-usable torchvision into a private folder DEST, for use
# via PYTHONPATH=DEST next to the CPU-only torch of the vLLM venv.
#
# Why: vLLM's multimodal helpers (and transformers' fast image processors)
# import torchvision, but the PyPI torchvision wheel is built against the CUDA
# torch and its compiled ops (torchvision::nms, ...) fail to register beside
# torch "+cpu".  torchvision/_meta_registrations.py then crashes at import
# time when it registers fake kernels for torchvision::nms / qnms.  The image
# transforms that vLLM needs are pure Python, so we install the wheel with
# --no-deps (so that pip never touches the venv's torch) into DEST and guard
# those two registrations so they only apply when the ops exist.
#
# Idempotent: re-running re-uses an existing install and an applied patch.
# Environment: PIP (default: pip on PATH), PYTHON (for the patch
# step; default: python beside PIP), TORCHVISION_VERSION (default 0.28.0).
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 DEST" >&2
    exit 2
fi
DEST=$1
PIP=${PIP:-pip}
# Interpreter for the patch step: $PYTHON, else the one beside $PIP, else python3.
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON=$(dirname "$PIP")/python
    [[ -x "$PYTHON" ]] || PYTHON=python3
fi
VERSION=${TORCHVISION_VERSION:-0.28.0}
META="$DEST/torchvision/_meta_registrations.py"
MARKER="# ec-daemon tests: nms/qnms guard"

mkdir -p "$DEST"

if [[ -f "$DEST/torchvision/version.py" ]] \
    && grep -q "__version__ = '$VERSION" "$DEST/torchvision/version.py"; then
    echo "[shim] torchvision $VERSION already installed in $DEST"
else
    echo "[shim] installing torchvision==$VERSION (--no-deps) into $DEST with $PIP"
    "$PIP" install --quiet --no-deps --upgrade --target "$DEST" "torchvision==$VERSION"
fi

if [[ ! -f "$META" ]]; then
    echo "[shim] ERROR: $META not found" >&2
    exit 1
fi

if grep -qF "$MARKER" "$META"; then
    echo "[shim] nms/qnms guard already applied to $META"
else
    echo "[shim] guarding torchvision::nms / torchvision::qnms fake registrations in $META"
    # The two registrations look like:
    #     @torch.library.register_fake("torchvision::nms")
    #     def meta_nms(dets, scores, iou_threshold):
    # Replace the decorator with one that is a no-op when the op is missing.
    "$PYTHON" - "$META" "$MARKER" <<'EOF'
import re
import sys

path, marker = sys.argv[1], sys.argv[2]
src = open(path).read()
helper = f'''
{marker}
def _register_fake_if_op_exists(op_name):
    """register_fake only when the compiled torchvision op is present."""
    ns, _, name = op_name.partition("::")
    try:
        getattr(getattr(torch.ops, ns), name)
    except (AttributeError, RuntimeError):
        return lambda fn: fn
    return torch.library.register_fake(op_name)

'''
pattern = re.compile(r'@torch\.library\.register_fake\("torchvision::(nms|qnms)"\)')
new, count = pattern.subn(
    lambda m: f'@_register_fake_if_op_exists("torchvision::{m.group(1)}")', src
)
if count != 2:
    sys.exit(f"[shim] ERROR: expected 2 nms/qnms registrations, found {count}")
# Insert the helper after the imports (before the first decorator use).
first = new.index("@_register_fake_if_op_exists")
new = new[:first] + helper.lstrip("\n") + "\n" + new[first:]
open(path, "w").write(new)
print(f"[shim] patched {count} registrations")
EOF
fi

echo "[shim] done; use: PYTHONPATH=$DEST"
