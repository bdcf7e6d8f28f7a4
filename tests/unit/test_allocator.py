import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ec_daemon.core.allocator import ExtentAllocator


def test_best_fit_takes_one_extent_when_a_run_fits():
    alloc = ExtentAllocator(100)
    assert alloc.allocate(10) == [(0, 10)]
    assert alloc.allocate(5) == [(10, 5)]
    assert alloc.free_pages == 85


def test_freed_neighbours_coalesce_into_one_run():
    alloc = ExtentAllocator(30)
    a, b, c = alloc.allocate(10), alloc.allocate(10), alloc.allocate(10)
    assert alloc.free_pages == 0
    alloc.free(a)
    alloc.free(c)
    assert alloc.free_runs == 2
    alloc.free(b)  # joins both neighbours
    assert alloc.free_runs == 1
    assert alloc.largest_free_run == 30
    assert alloc.allocate(30) == [(0, 30)]


def test_best_fit_prefers_the_smallest_run_that_fits():
    alloc = ExtentAllocator(100)
    runs = [alloc.allocate(10) for _ in range(10)]
    alloc.free(runs[1])  # a hole of 10 at page 10
    alloc.free(runs[5])
    alloc.free(runs[6])  # a hole of 20 at page 50
    assert alloc.allocate(8) == [(10, 8)]
    assert alloc.allocate(15) == [(50, 15)]


def test_fragmented_space_gives_fewest_extents_largest_first():
    alloc = ExtentAllocator(100)
    runs = [alloc.allocate(10) for _ in range(10)]
    for i in (1, 3, 4, 7):  # holes: 10 at 10, 20 at 30, 10 at 70
        alloc.free(runs[i])
    got = alloc.allocate(25)
    assert got == [(30, 20), (10, 5)]  # largest run whole, then best fit for the rest
    assert sum(n for _, n in got) == 25
    assert alloc.free_pages == 15


def test_exhaustion_returns_none_and_changes_nothing():
    alloc = ExtentAllocator(10)
    alloc.allocate(7)
    assert alloc.allocate(4) is None
    assert alloc.free_pages == 3
    assert alloc.allocate(3) == [(7, 3)]
    assert alloc.allocate(1) is None


def test_double_free_and_bad_runs_are_refused():
    alloc = ExtentAllocator(10)
    run = alloc.allocate(4)
    alloc.free(run)
    with pytest.raises(ValueError, match="already free"):
        alloc.free(run)
    with pytest.raises(ValueError, match="outside"):
        alloc.free([(8, 5)])
    with pytest.raises(ValueError):
        alloc.allocate(0)
    assert alloc.free_pages == 10


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=120))
def test_random_churn_keeps_pages_accounted_and_disjoint(ops):
    total = 256
    alloc = ExtentAllocator(total)
    held: list[list[tuple[int, int]]] = []
    for is_alloc, n in ops:
        if is_alloc or not held:
            runs = alloc.allocate(n)
            if runs is None:
                assert alloc.free_pages < n
                continue
            assert sum(length for _, length in runs) == n
            held.append(runs)
        else:
            alloc.free(held.pop(n % len(held)))
        owned = sorted(r for runs in held for r in runs)
        for (s1, n1), (s2, _) in itertools.pairwise(owned):
            assert s1 + n1 <= s2, "two allocations overlap"
        assert sum(n for _, n in owned) + alloc.free_pages == total
    for runs in held:
        alloc.free(runs)
    assert alloc.free_runs == 1 and alloc.free_pages == total
