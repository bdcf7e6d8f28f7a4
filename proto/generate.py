"""Generate the Python stubs of proto/ into ec_protocol/_proto (one module for
both packages). Run by `make proto` and by the package build (setup.py)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
# Stubs import each other by this package path, so protoc sees the sources
# under it (a virtual include path); no hand edits of generated code.
PACKAGE_PATH = "ec_protocol/_proto"


def generate(out_root: Path = ROOT) -> list[Path]:
    from grpc_tools import protoc  # build-time dependency only

    sources = sorted(PROTO_DIR.rglob("*.proto"))
    args = [
        "grpc_tools.protoc",
        f"-I{PACKAGE_PATH}={PROTO_DIR}",
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(s) for s in sources),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + ", ".join(map(str, sources)))
    package = out_root / PACKAGE_PATH
    created = []
    for folder in [package, *(p for p in package.rglob("*") if p.is_dir())]:
        if folder.name == "__pycache__":
            continue
        init = folder / "__init__.py"
        if not init.exists():
            init.write_text('"""Generated from proto/ by proto/generate.py."""\n')
        created.append(init)
    return created


if __name__ == "__main__":
    generate()
    print(f"generated stubs under {ROOT / PACKAGE_PATH}", file=sys.stderr)
