"""The engine token: every process of one engine derives the same one (so
its workers count from their attach, before any step), no two engines share
one, and nothing another user could read or plant is ever used."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from ec_client.engine_token import (
    SECRET_NAME,
    derived_engine_token,
    new_engine_token,
    user_secret,
)
from ec_protocol.protocol import engine_token_problem


def test_the_engines_processes_derive_one_token_and_other_engines_another(tmp_path):
    folder = tmp_path / "run"
    token = derived_engine_token("engine_dp0", "1733200000000000001", folder)
    assert engine_token_problem(token) is None and len(token) == 32
    assert derived_engine_token("engine_dp0", "1733200000000000001", folder) == token
    # The same explicit engine id in another vLLM instance, another DP rank.
    assert derived_engine_token("engine_dp0", "1733200000000000002", folder) != token
    assert derived_engine_token("engine_dp1", "1733200000000000001", folder) != token
    # Another user's (or host's) secret derives another token.
    assert derived_engine_token("engine_dp0", "1733200000000000001", tmp_path / "b") != token
    assert engine_token_problem(new_engine_token()) is None
    assert new_engine_token() != new_engine_token()


def test_the_secret_is_a_private_file(tmp_path):
    folder = tmp_path / "run"
    user_secret(folder)
    info = (folder / SECRET_NAME).stat()
    assert oct(info.st_mode & 0o777) == oct(0o600) and info.st_uid == os.geteuid()
    assert oct(folder.stat().st_mode & 0o077) == oct(0)


@pytest.mark.parametrize("loosen", ["folder writable by others", "secret readable by others",
                                    "secret is a symlink", "secret of the wrong size"])
def test_a_secret_others_could_read_or_plant_is_never_used(tmp_path, loosen):
    folder = tmp_path / "run"
    assert user_secret(folder) is not None
    secret = folder / SECRET_NAME
    if loosen == "folder writable by others":
        folder.chmod(0o777)
    elif loosen == "secret readable by others":
        secret.chmod(0o644)
    elif loosen == "secret is a symlink":
        planted = tmp_path / "planted"
        planted.write_bytes(b"x" * 32)
        planted.chmod(0o600)
        secret.unlink()
        secret.symlink_to(planted)
    else:
        secret.write_bytes(b"short")
    assert user_secret(folder) is None
    assert derived_engine_token("E", "1", folder) == ""  # the worker waits for its metadata


def test_processes_that_make_the_secret_at_once_all_use_one(tmp_path: Path):
    folder = tmp_path / "run"
    got: list[bytes | None] = []
    threads = [threading.Thread(target=lambda: got.append(user_secret(folder)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(got) == 8 and None not in got and len(set(got)) == 1
    assert sorted(p.name for p in folder.iterdir()) == [SECRET_NAME]  # no temporary left
