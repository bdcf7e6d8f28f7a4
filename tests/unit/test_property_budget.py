"""Property tests stop at their count cap or their time budget, whichever
comes first, and say how many cases ran."""

from __future__ import annotations

import time

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from tests.property_budget import Budget, run_given, run_machine


def test_a_fast_test_stops_at_its_count() -> None:
    seen: list[int] = []
    spent = run_given(Budget(examples=250, seconds=60), lambda n: seen.append(n), st.integers())
    # Hypothesis may abandon a case part-way and not count it: a few more ran.
    assert spent.cases == len(seen) and 250 <= spent.cases < 260
    assert spent.stopped_by == "count"


def test_a_slow_test_stops_at_its_time_budget() -> None:
    spent = run_given(Budget(examples=10**6, seconds=0.5), lambda _: time.sleep(0.005),
                      st.integers())
    assert spent.stopped_by == "time"
    assert 0 < spent.cases < 10**6 and spent.seconds < 2.0


def test_cases_slower_than_hypothesis_default_deadline_pass() -> None:
    spent = run_given(Budget(examples=2, seconds=60), lambda _: time.sleep(0.25),
                      st.integers())
    assert spent.cases == 2


def test_a_small_search_space_ends_when_exhausted() -> None:
    spent = run_given(Budget(examples=1000, seconds=60), lambda _: None, st.booleans())
    assert spent.stopped_by == "exhausted" and spent.cases <= 2


class Counter(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.value = 0

    @rule(step=st.integers(0, 3))
    def add(self, step: int) -> None:
        self.value += step
        assert self.value >= 0


def test_a_state_machine_counts_one_case_per_run() -> None:
    spent = run_machine(Budget(examples=30, seconds=60), Counter, stateful_step_count=5)
    assert 30 <= spent.cases < 40 and spent.stopped_by == "count"


def test_the_spent_budget_is_recorded_for_junit() -> None:
    recorded: dict[str, object] = {}
    spent = run_given(Budget(examples=5, seconds=60), lambda _: None, st.integers())
    spent.record(lambda name, value: recorded.__setitem__(name, value))
    assert recorded["hypothesis_cases"] == 5 and recorded["hypothesis_stopped_by"] == "count"
