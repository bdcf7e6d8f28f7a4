"""benchmarks.vllm_source: vLLM's proxy taken from a source release found
through a simple index, checked against the index's sha256, and cached. A
stand-in index and file server on loopback play PyPI."""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from benchmarks import vllm_source
from benchmarks.vllm_source import PROXY_MEMBER, SourceUnavailable, epd_proxy

PROXY = b"# vLLM's proxy, as released\n"


def sdist(version: str, proxy: bytes = PROXY) -> bytes:
    """The same bytes for the same arguments (gzip's header time fixed: two
    calls a second apart made two sha256s, and the index then vouched for
    neither)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        info = tarfile.TarInfo(f"vllm-{version}/{PROXY_MEMBER}")
        info.size = len(proxy)
        tar.addfile(info, io.BytesIO(proxy))
    return gzip.compress(out.getvalue(), mtime=0)


class PyPI:
    """An index page listing `files` (name -> bytes) with their sha256, or
    with `digests` overriding them; serves the files."""

    def __init__(self, files: dict[str, bytes], digests: dict[str, str] | None = None) -> None:
        self.files = files
        self.requests: list[str] = []
        pypi = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                pypi.requests.append(self.path)
                if self.path == "/simple/vllm/":
                    body = "".join(
                        f'<a href="{pypi.url}/files/{name}#sha256='
                        f'{(digests or {}).get(name) or hashlib.sha256(data).hexdigest()}">'
                        f"{name}</a>\n" for name, data in files.items()).encode()
                else:
                    body = files.get(self.path.rsplit("/", 1)[-1], b"")
                self.send_response(200 if body else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def pypi(monkeypatch: pytest.MonkeyPatch) -> Iterator[PyPI]:
    server = PyPI({"vllm-9.9.9.tar.gz": sdist("9.9.9"), "vllm-9.9.8.tar.gz": sdist("9.9.8")})
    monkeypatch.setattr(vllm_source, "INDEX", f"{server.url}/simple/vllm/")
    monkeypatch.delenv(vllm_source.SDIST_ENV, raising=False)
    yield server
    server.close()


def test_the_proxy_of_the_release_asked_for_is_downloaded_once_then_cached(pypi, tmp_path):
    proxy = epd_proxy("9.9.9", tmp_path)
    assert proxy.read_bytes() == PROXY
    assert pypi.requests == ["/simple/vllm/", "/files/vllm-9.9.9.tar.gz"]
    pypi.close()  # PyPI gone: the cache serves
    assert epd_proxy("9.9.9", tmp_path) == proxy
    assert [p.name for p in tmp_path.iterdir()] == ["vllm-9.9.9"]  # no sdist left behind


def test_a_local_copy_of_the_sdist_is_used_when_the_index_vouches_for_it(pypi, tmp_path,
                                                                          monkeypatch):
    local = tmp_path / "vllm-9.9.9.tar.gz"
    local.write_bytes(sdist("9.9.9"))
    monkeypatch.setenv(vllm_source.SDIST_ENV, str(local))
    assert epd_proxy("9.9.9", tmp_path / "cache").read_bytes() == PROXY
    assert pypi.requests == ["/simple/vllm/"]  # not downloaded
    local.write_bytes(sdist("9.9.9", b"# tampered\n"))  # no longer the index's sha256
    assert epd_proxy("9.9.9", tmp_path / "other").read_bytes() == PROXY  # downloaded instead
    assert pypi.requests[-1] == "/files/vllm-9.9.9.tar.gz"


def test_a_download_that_does_not_match_the_index_is_refused(monkeypatch, tmp_path):
    server = PyPI({"vllm-9.9.9.tar.gz": sdist("9.9.9")}, digests={"vllm-9.9.9.tar.gz": "0" * 64})
    monkeypatch.setattr(vllm_source, "INDEX", f"{server.url}/simple/vllm/")
    try:
        with pytest.raises(SourceUnavailable, match="does not match the index's sha256") as got:
            epd_proxy("9.9.9", tmp_path)
        assert not got.value.unreachable  # a wrong answer: the tests fail, never skip
        assert not (tmp_path / "vllm-9.9.9" / "disagg_epd_proxy.py").exists()
    finally:
        server.close()


def test_a_release_the_index_does_not_list_or_an_unreachable_index_says_why(pypi, tmp_path):
    with pytest.raises(SourceUnavailable, match=r"lists no vllm-1\.0\.0\.tar\.gz"):
        epd_proxy("1.0.0", tmp_path)
    pypi.close()
    with pytest.raises(SourceUnavailable, match="unreachable") as got:
        epd_proxy("9.9.8", tmp_path)
    assert got.value.unreachable  # the one case a run outside CI may skip
    assert not (tmp_path / "vllm-9.9.8" / "disagg_epd_proxy.py").exists()
