"""CUDA copy backends: bit-exact saves and loads through the registered
region, while the default stream is busy with compute. Skipped without CUDA."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

from ec_client.copy import get_backend  # noqa: E402
from ec_client.mapping import RegionMapping  # noqa: E402

pytestmark = pytest.mark.gpu
BACKENDS = ["torch", "cupy"]


@pytest.fixture
def mapping(tmp_path):
    path = tmp_path / "region"
    with open(path, "wb") as f:
        f.truncate(64 << 20)
    m = RegionMapping(str(path), 64 << 20, generation=1)
    yield m
    m.close()


@pytest.fixture(params=BACKENDS)
def backend(request, mapping):
    if request.param == "cupy":
        pytest.importorskip("cupy")
    b = get_backend(request.param)
    b.attach(mapping)
    yield b
    b.detach(mapping)


def busy_default_stream():
    """Queue a long matmul chain on the current stream."""
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        a = a @ a
        a = a / a.norm()
    return a


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_save_then_load_is_bit_exact_under_compute(backend, mapping, dtype):
    rows = 1000
    source = torch.randn(rows, 1152, device="cuda").to(dtype)
    nbytes = source.numel() * source.element_size()
    extents = [(8 << 20, nbytes // 2), (1 << 20, nbytes - nbytes // 2)]  # scattered
    busy_default_stream()
    produced = source * 1  # written by the compute stream right before the save
    ready = backend.prepare_save(produced)
    backend.save(produced, mapping, extents, ready)
    busy_default_stream()
    out = torch.empty_like(source)
    backend.load(mapping, extents, out)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(out, source)


def test_auto_picks_torch_on_cuda():
    assert get_backend("auto").name == "torch"
