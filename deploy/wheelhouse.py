"""Download a wheelhouse for building the images without network access.

    python deploy/wheelhouse.py wheels            # the daemon image's needs
    python deploy/wheelhouse.py wheels numpy      # + extras (the client image: numpy)

Collects the package's build requirements (setuptools, grpcio-tools) and
runtime dependencies from pyproject.toml, plus the extras named, and has
pip download binary wheels for the image's Python (CPython 3.11, Linux, this
machine's architecture, glibc up to --glibc: Debian bookworm has 2.36)
into the folder. A build given that folder installs from it only
(`pip install --no-index --find-links`, see the Dockerfile). This needs
PyPI (or the index pip is configured with); the image builds do not.

pip evaluates environment markers against the interpreter running it, not
the target (`--python-version` only picks wheels), so a dependency such as
redis's `async-timeout; python_full_version < "3.11.3"` would be missed for
Debian's 3.11.2 when this runs on 3.11.7. The wheels' own requirements are
therefore re-evaluated for the target (any 3.11.x) and whatever is missing
is downloaded too, until nothing is.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    sys.exit("deploy/wheelhouse.py needs Python >= 3.11 (tomllib)")
# pip's own copy: pip is needed anyway, `packaging` may not be installed.
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
MAX_ROUNDS = 10


def requirements(extras: list[str]) -> list[str]:
    """Build requirements, dependencies, and the named optional extras."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    reqs = list(project["build-system"]["requires"]) + list(project["project"]["dependencies"])
    optional = project["project"].get("optional-dependencies", {})
    for extra in extras:
        reqs += optional.get(extra, [extra])  # an extra's list, or a requirement itself
    return sorted(set(reqs))


def platforms(glibc: str, machine: str) -> list[str]:
    """pip's --platform tags for a glibc of at most `glibc` on `machine`
    (pip does not expand manylinux_2_X to older glibcs by itself)."""
    major, minor = (int(part) for part in glibc.split("."))
    tags = [f"manylinux_{major}_{m}_{machine}" for m in range(minor, 4, -1)]
    return [*tags, f"manylinux2014_{machine}", f"manylinux2010_{machine}",
            f"manylinux1_{machine}"]


def environments(python_version: str, machine: str) -> list[dict[str, str]]:
    """Marker environments of the target: the first and a late micro release
    of `python_version`, so both sides of a micro-version marker count."""
    envs = []
    for micro in ("0", "99"):
        envs.append({
            "implementation_name": "cpython", "implementation_version": f"{python_version}.{micro}",
            "os_name": "posix", "platform_machine": machine, "platform_python_implementation":
            "CPython", "platform_release": "", "platform_system": "Linux", "platform_version": "",
            "python_full_version": f"{python_version}.{micro}", "python_version": python_version,
            "sys_platform": "linux"})
    return envs


def wheel_requirements(wheel: Path) -> tuple[str, list[str]]:
    """(project name, Requires-Dist lines) of a wheel."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(name).decode())
    return canonicalize_name(metadata["Name"]), metadata.get_all("Requires-Dist") or []


def missing(folder: Path, wanted: list[str], envs: list[dict[str, str]]) -> list[str]:
    """Requirements that some target environment needs and no wheel in
    `folder` provides (following the requirements of the wheels there)."""
    wheels = dict(wheel_requirements(w) for w in folder.glob("*.whl"))
    extras: dict[str, set[str]] = {}
    todo = [Requirement(r) for r in wanted]
    needed: dict[str, Requirement] = {}
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if req.marker is not None and not any(req.marker.evaluate(env) for env in envs):
            continue
        new_extras = set(req.extras) - extras.get(name, set())
        if name in needed and not new_extras:
            continue
        needed.setdefault(name, req)
        extras.setdefault(name, set()).update(req.extras)
        for line in wheels.get(name, []):
            dep = Requirement(line)
            if dep.marker is None or any(dep.marker.evaluate({**env, "extra": extra})
                                         for env in envs for extra in ("", *extras[name])):
                dep.marker = None
                todo.append(dep)
    return sorted(str(req) for name, req in needed.items() if name not in wheels)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("extras", nargs="*", help="extras of pyproject.toml or requirements")
    parser.add_argument("--python-version", default="3.11")
    parser.add_argument("--glibc", default="2.36")
    parser.add_argument("--machine", default=platform.machine())
    args = parser.parse_args(argv)
    args.folder.mkdir(parents=True, exist_ok=True)
    reqs = requirements(args.extras)
    abi = "cp" + args.python_version.replace(".", "")
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
               "--dest", str(args.folder), "--only-binary=:all:", "--implementation", "cp",
               "--python-version", args.python_version, "--abi", abi]
    for tag in platforms(args.glibc, args.machine):
        command += ["--platform", tag]
    print(f">> downloading wheels for CPython {args.python_version} ({args.machine}, glibc <= "
          f"{args.glibc}) into {args.folder}: {' '.join(reqs)}", flush=True)
    envs = environments(args.python_version, args.machine)
    batch = reqs
    for _ in range(MAX_ROUNDS):
        status = subprocess.call([*command, *batch])
        if status:
            return status
        batch = missing(args.folder, reqs, envs)
        if not batch:
            return 0
        print(f">> also needed by some CPython {args.python_version}.x: {' '.join(batch)}",
              flush=True)
    print(f"wheelhouse: still missing after {MAX_ROUNDS} rounds: {' '.join(batch)}",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
