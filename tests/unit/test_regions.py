"""Regions: a worker's mappings by generation. A mapping a copy uses is
never unmapped; retired ones go after RETIRE_SECONDS; each is registered
with the copy backend once and unregistered once."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import ec_client.worker_side.regions as regions_module
from ec_client.common.contract import RegionInfo
from ec_client.copy.mapping import RegionMapping
from ec_client.worker_side.regions import RETIRE_SECONDS, Regions

PAGE = 4096
SIZE = 4 * PAGE


def region_file(folder: Path, generation: int) -> RegionInfo:
    """A region file whose payload is filled with the generation's number."""
    path = folder / f"region-{generation}"
    path.write_bytes(bytes(PAGE) + bytes([generation]) * (SIZE - PAGE))
    return RegionInfo(str(path), SIZE, generation, PAGE, PAGE)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    """The copy backend's attach/detach hooks."""

    def __init__(self) -> None:
        self.mapped: list[int] = []
        self.unmapped: list[int] = []

    def on_map(self, mapping: RegionMapping) -> None:
        self.mapped.append(mapping.generation)

    def on_unmap(self, mapping: RegionMapping) -> None:
        self.unmapped.append(mapping.generation)


@pytest.fixture
def hooks() -> Recorder:
    return Recorder()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def regions(hooks: Recorder, clock: Clock) -> Iterator[Regions]:
    r = Regions(on_map=hooks.on_map, on_unmap=hooks.on_unmap, clock=clock)
    yield r
    r.close()


def test_use_maps_on_first_use_and_reuses_the_mapping(tmp_path, regions, hooks):
    info = region_file(tmp_path, 1)
    with regions.use(info) as (mapping, stamps):
        assert bytes(mapping.view[PAGE:PAGE + 4]) == b"\x01" * 4
        assert stamps.data_offset == PAGE and stamps.page_bytes == PAGE
        with regions.use(info) as (again, _):
            assert again is mapping
    with regions.use(info) as (later, _):
        assert later is mapping
    assert hooks.mapped == [1] and hooks.unmapped == []


def test_the_current_region_is_never_retired(tmp_path, regions, hooks, clock):
    info = region_file(tmp_path, 1)
    regions.make_current(info)
    assert regions.current == 1 and hooks.mapped == [1]  # mapped at attach, before any load
    clock.now += 10 * RETIRE_SECONDS
    regions.prune()
    assert regions.generations() == [1] and hooks.unmapped == []


def test_a_reattach_to_the_same_daemon_keeps_its_mapping(tmp_path, regions, hooks, clock):
    info = region_file(tmp_path, 1)
    regions.make_current(info)
    regions.make_current(None)  # the stream was lost ...
    clock.now += 1
    regions.make_current(info)  # ... and the link attached to the same daemon again
    clock.now += 10 * RETIRE_SECONDS
    regions.prune()
    assert regions.generations() == [1] and hooks.mapped == [1] and hooks.unmapped == []


def test_a_retired_mapping_is_unmapped_after_the_grace(tmp_path, regions, hooks, clock):
    old, new = region_file(tmp_path, 1), region_file(tmp_path, 2)
    regions.make_current(old)
    regions.make_current(new)
    clock.now += RETIRE_SECONDS - 1
    regions.prune()
    assert regions.generations() == [1, 2]  # a load dispatched before the restart may come
    with regions.use(old) as (mapping, _):
        assert bytes(mapping.view[PAGE:PAGE + 1]) == b"\x01"
    clock.now += 1
    regions.prune()
    assert regions.generations() == [2]
    assert regions.wait_released(10)
    assert hooks.mapped == [1, 2] and hooks.unmapped == [1]


def test_a_detach_retires_every_mapping(tmp_path, regions, hooks, clock):
    regions.make_current(region_file(tmp_path, 1))
    regions.make_current(None)
    assert regions.current is None
    clock.now += RETIRE_SECONDS
    regions.prune()
    assert regions.wait_released(10)
    assert regions.generations() == [] and hooks.unmapped == [1]


def test_an_old_generation_used_after_it_was_unmapped_is_mapped_again_and_retired(
        tmp_path, regions, hooks, clock):
    old, new = region_file(tmp_path, 1), region_file(tmp_path, 2)
    regions.make_current(old)
    regions.make_current(new)
    clock.now += RETIRE_SECONDS
    regions.prune()
    with regions.use(old) as (mapping, _):  # a straggling load of the old daemon
        assert bytes(mapping.view[PAGE:PAGE + 1]) == b"\x01"
    assert regions.generations() == [1, 2]
    clock.now += RETIRE_SECONDS
    regions.prune()
    assert regions.generations() == [2]
    assert regions.wait_released(10)
    assert hooks.mapped == [1, 2, 1] and hooks.unmapped == [1, 1]


def test_a_mapping_in_use_by_a_copy_is_never_unmapped(tmp_path, regions, hooks, monkeypatch):
    monkeypatch.setattr(regions_module, "RETIRE_SECONDS", 0.0)
    old, new = region_file(tmp_path, 1), region_file(tmp_path, 2)
    regions.make_current(old)
    copying, finish = threading.Event(), threading.Event()
    seen: list[bytes] = []

    def copy() -> None:
        with regions.use(old) as (mapping, _):
            copying.set()
            finish.wait(10)
            seen.append(bytes(mapping.view[PAGE:SIZE]))  # still readable

    copier = threading.Thread(target=copy)
    copier.start()
    try:
        assert copying.wait(10)
        regions.make_current(new)  # the daemon restarted under the copy
        Path(old.path).unlink()  # and removed its file
        regions.prune()
        assert regions.generations() == [1, 2] and hooks.unmapped == []
    finally:
        finish.set()
        copier.join(10)
    assert seen == [b"\x01" * (SIZE - PAGE)]
    regions.prune()
    assert regions.wait_released(10)
    assert regions.generations() == [2] and hooks.unmapped == [1]


def test_close_unmaps_everything_once(tmp_path, regions, hooks):
    regions.make_current(region_file(tmp_path, 1))
    regions.make_current(region_file(tmp_path, 2))
    regions.close()
    assert regions.generations() == []
    assert sorted(hooks.unmapped) == [1, 2]
    regions.close()
    assert sorted(hooks.unmapped) == [1, 2]


def test_a_region_file_that_does_not_exist_raises_oserror(tmp_path, regions, hooks):
    info = RegionInfo(str(tmp_path / "gone"), SIZE, 9, PAGE, PAGE)
    with pytest.raises(OSError), regions.use(info):
        pass
    assert regions.generations() == [] and hooks.mapped == []


def test_a_mapping_the_backend_refuses_is_not_kept(tmp_path, clock):
    def refuse(mapping: RegionMapping) -> None:
        raise RuntimeError("cannot register host memory")

    unmapped: list[int] = []
    regions = Regions(on_map=refuse, on_unmap=lambda m: unmapped.append(m.generation),
                      clock=clock)
    with pytest.raises(RuntimeError), regions.use(region_file(tmp_path, 1)):
        pass
    assert regions.generations() == [] and unmapped == []  # never registered


def test_a_region_the_scheduler_may_still_load_from_stays_while_the_engine_works(
        tmp_path, regions, hooks, clock):
    """A daemon replaced by a fresh region: the worker is in a step whose
    metadata names the old generation (a load of it may follow, however slow
    the step): kept past any grace. A step that no longer names it, or an
    idle worker, lets it go."""
    old, new = region_file(tmp_path, 1), region_file(tmp_path, 2)
    regions.make_current(old)
    regions.step(frozenset({1}))
    regions.make_current(new)
    clock.now += 100 * RETIRE_SECONDS
    regions.prune()
    assert regions.generations() == [1, 2]
    regions.step_done()
    regions.step(frozenset({1}))  # the next step still names it
    clock.now += 100 * RETIRE_SECONDS
    regions.prune()
    assert regions.generations() == [1, 2]
    regions.step_done()
    regions.step(frozenset({2}))
    regions.step_done()
    assert regions.wait_released(10)
    assert regions.generations() == [2] and hooks.unmapped == [1]


def test_an_idle_worker_unmaps_a_retired_region_after_the_grace(tmp_path, regions, hooks,
                                                                 clock):
    old, new = region_file(tmp_path, 1), region_file(tmp_path, 2)
    regions.make_current(old)
    regions.step(frozenset({1}))
    regions.step_done()  # the last step named it; then nothing more comes
    regions.make_current(new)
    clock.now += RETIRE_SECONDS / 2
    regions.prune()
    assert regions.generations() == [1, 2]
    clock.now += RETIRE_SECONDS
    regions.prune()
    assert regions.wait_released(10)
    assert regions.generations() == [2] and hooks.unmapped == [1]


def test_a_step_after_a_daemon_restart_never_waits_for_the_old_regions_release(tmp_path, clock):
    """Releasing a retired mapping (a CUDA backend's detach synchronises its
    copy streams, joins its registrar and unregisters every chunk) is the
    release thread's work: the engine thread's step, whose boundaries prune,
    goes on while it is still under way."""
    releasing, finish = threading.Event(), threading.Event()
    released: list[int] = []

    def slow_detach(mapping: RegionMapping) -> None:
        releasing.set()
        finish.wait(30)
        released.append(mapping.generation)

    regions = Regions(on_unmap=slow_detach, clock=clock)
    old, new = region_file(tmp_path, 1), region_file(tmp_path, 2)
    regions.make_current(old)
    regions.make_current(new)  # the daemon restarted with a fresh region
    clock.now += RETIRE_SECONDS

    def engine_step() -> None:
        regions.step(frozenset({2}))
        with regions.use(new):  # a load
            pass
        regions.step_done()

    engine = threading.Thread(target=engine_step, name="engine")
    try:
        engine.start()
        assert releasing.wait(10)  # the old mapping is being released...
        engine.join(10)
        assert not engine.is_alive()  # ...and the step did not wait for it
        assert regions.generations() == [2] and released == []
    finally:
        finish.set()
        engine.join(10)
    assert regions.wait_released(10) and released == [1]
    regions.close()
