import numpy as np
import pytest

from ec_client.copy import describe, empty_host, get_backend
from ec_client.copy.mapping import RegionMapping
from tests.copy_views import VIEWS, non_contiguous


@pytest.fixture
def mapping(tmp_path):
    path = tmp_path / "region"
    path.write_bytes(b"\0" * (1 << 16))
    m = RegionMapping(str(path), 1 << 16, generation=1)
    yield m
    m.close()


def test_save_then_load_across_scattered_extents_is_bit_exact(mapping):
    backend = get_backend("cpu")
    data = np.random.default_rng(0).standard_normal((3, 1000)).astype(np.float32)
    extents = [(40000, 4096), (0, 6000), (20000, data.nbytes - 4096 - 6000)]
    backend.save(data, mapping, extents)
    out = backend.load(mapping, extents, np.empty_like(data))
    assert np.array_equal(out, data)
    assert bytes(mapping.view[0:6000]) == data.tobytes()[4096:4096 + 6000]


def test_torch_bfloat16_round_trips(mapping):
    torch = pytest.importorskip("torch")
    backend = get_backend("cpu")
    data = torch.randn(7, 33).to(torch.bfloat16)
    nbytes, shape, dtype = describe(data)
    assert (nbytes, shape, dtype) == (7 * 33 * 2, (7, 33), "bfloat16")
    backend.save(data, mapping, [(100, nbytes)])
    out = backend.load(mapping, [(100, nbytes)], empty_host(shape, dtype))
    assert torch.equal(out, data)


def test_mismatched_sizes_and_out_of_region_extents_are_refused(mapping):
    backend = get_backend("cpu")
    data = np.zeros(100, np.uint8)
    with pytest.raises(ValueError, match="extents hold"):
        backend.save(data, mapping, [(0, 50)])
    with pytest.raises(ValueError, match="outside the region"):
        backend.save(data, mapping, [(mapping.size - 50, 100)])




@pytest.mark.parametrize("kind", VIEWS)
def test_a_non_contiguous_numpy_source_is_saved_in_row_major_order(mapping, kind):
    backend = get_backend("cpu")
    base = np.random.default_rng(1).standard_normal((6, 10)).astype(np.float32)
    source = non_contiguous(kind, base)
    expected = np.ascontiguousarray(source)
    extents = [(30000, 64), (500, expected.nbytes - 64)]
    backend.save(source, mapping, extents)
    stored = bytes(mapping.view[30000:30064]) + bytes(mapping.view[500:500 + expected.nbytes - 64])
    assert stored == expected.tobytes()
    out = backend.load(mapping, extents, np.empty(source.shape, source.dtype))
    assert np.array_equal(out, expected)


@pytest.mark.parametrize("kind", VIEWS)
def test_a_non_contiguous_torch_source_is_saved_in_row_major_order(mapping, kind):
    torch = pytest.importorskip("torch")
    backend = get_backend("cpu")
    base = torch.randn(6, 10, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    source = non_contiguous(kind, base)
    assert not source.is_contiguous() or source.storage_offset() > 0
    expected = source.contiguous()
    nbytes, shape, dtype = describe(source)
    backend.save(source, mapping, [(100, nbytes)])
    assert bytes(mapping.view[100:100 + nbytes]) == expected.view(torch.uint8).numpy().tobytes()
    out = backend.load(mapping, [(100, nbytes)], empty_host(shape, dtype))
    assert torch.equal(out, expected)


def test_a_strided_bytes_like_source_is_saved_in_row_major_order(mapping):
    backend = get_backend("cpu")
    backend.save(memoryview(b"abcdefgh")[::2], mapping, [(7, 4)])
    assert bytes(mapping.view[7:11]) == b"aceg"


def test_a_non_contiguous_load_destination_is_refused(mapping):
    backend = get_backend("cpu")
    backend.save(np.arange(10, dtype=np.float32), mapping, [(0, 40)])
    with pytest.raises(TypeError, match="not C-contiguous"):
        backend.load(mapping, [(0, 40)], np.empty((2, 5), np.float32).T)
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="not contiguous"):
        backend.load(mapping, [(0, 40)], torch.empty(2, 5).T)


def test_unknown_backend_names_are_refused():
    with pytest.raises(ValueError, match="unknown copy backend"):
        get_backend("gpu")


def test_auto_picks_cpu_without_cuda():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: auto picks a GPU backend")
    assert get_backend("auto").name == "cpu"


def test_a_custom_backend_is_loaded_by_module_and_class_name():
    backend = get_backend("ec_client.copy.cpu_backend:Backend")
    assert backend.name == "cpu"


@pytest.mark.parametrize("name", ["ec_client.copy.cpu_backend:", ":Backend", "a:b:c",
                                  "not a module:Backend", "gpu"])
def test_malformed_or_unknown_backend_names_are_refused(name):
    with pytest.raises(ValueError):
        get_backend(name)


def test_a_custom_backend_that_does_not_exist_raises_import_error():
    with pytest.raises(ImportError):
        get_backend("ec_client.copy.cpu_backend:NoSuchBackend")
    with pytest.raises(ImportError):
        get_backend("no_such_package_here.copy:Backend")


class OldInterface:
    """A custom backend written before `device`, `stats`, `empty` and `pinned`."""

    name = "old"

    def attach(self, mapping: object) -> None: ...
    def detach(self, mapping: object) -> None: ...
    def prepare_save(self, source: object) -> None: ...
    def save(self, *args: object) -> None: ...
    def load(self, *args: object) -> None: ...


def test_a_custom_backend_missing_part_of_the_interface_is_refused_when_loaded():
    """Refused at the engine's start, with what it lacks, not at its first step."""
    with pytest.raises(TypeError, match="lacks device, stats, pinned, empty"):
        get_backend("tests.unit.test_copy_cpu:OldInterface")
