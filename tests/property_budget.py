"""Long Hypothesis tests sized by time as well as by count.

A property test whose cases wait on a real daemon, or on a loaded machine,
slows down with the load: sized by a count alone it can outrun
pytest-timeout, and Hypothesis then reports the interrupted run as a
FlakyFailure. Here generation runs in rounds of a few seconds each and stops
when the count cap is reached or the time budget is spent, whichever comes
first (a round in progress finishes). Deadlines are off: a case's time says
nothing about the code under a loaded machine. How many cases ran is recorded
as junit properties (`hypothesis_cases`, `hypothesis_seconds`,
`hypothesis_stopped_by`) and listed in pytest's summary.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test
from hypothesis.strategies import SearchStrategy

FIRST_ROUND_CASES = 10  # a probe round, to learn how long a case takes
ROUND_SECONDS = 5.0


@dataclass(frozen=True)
class Budget:
    """At most `examples` cases, generated for at most `seconds`."""

    examples: int
    seconds: float

    @classmethod
    def from_env(cls, examples_var: str, examples: int, seconds_var: str,
                 seconds: float) -> Budget:
        """The budget given by two environment variables, else the defaults."""
        return cls(int(os.environ.get(examples_var, examples)),
                   float(os.environ.get(seconds_var, seconds)))


@dataclass(frozen=True)
class Spent:
    """What a budgeted run did. `cases` counts the calls of the test (a few
    more than the count cap when Hypothesis abandons a case part-way and
    does not count it); `stopped_by` is count, time or exhausted (Hypothesis
    found no new cases to try)."""

    cases: int
    seconds: float
    stopped_by: str

    def record(self, record_property: Callable[[str, object], None]) -> None:
        record_property("hypothesis_cases", self.cases)
        record_property("hypothesis_seconds", round(self.seconds, 1))
        record_property("hypothesis_stopped_by", self.stopped_by)
        print(f"{self.cases} cases in {self.seconds:.1f}s (stopped by {self.stopped_by})")


def run_rounds(budget: Budget, run_round: Callable[[int], int]) -> Spent:
    """Call `run_round(n)`, which runs at most n cases and returns how many
    it ran, until the budget is spent. Exceptions of a round propagate."""
    started = time.monotonic()
    cases = 0
    stopped_by = "count"
    while cases < budget.examples:
        elapsed = time.monotonic() - started
        if elapsed >= budget.seconds:
            stopped_by = "time"
            break
        wanted = _round_size(budget, cases, elapsed)
        ran = run_round(wanted)
        cases += ran
        if ran < wanted:
            stopped_by = "exhausted"
            break
    return Spent(cases, time.monotonic() - started, stopped_by)


def _round_size(budget: Budget, cases: int, elapsed: float) -> int:
    left = budget.examples - cases
    if cases == 0:
        return min(FIRST_ROUND_CASES, left)
    per_case = max(elapsed / cases, 1e-6)
    seconds = min(ROUND_SECONDS, budget.seconds - elapsed)
    return max(1, min(left, int(seconds / per_case)))


def run_given(budget: Budget, body: Callable[..., None], *strategies: SearchStrategy[Any],
              **options: Any) -> Spent:
    """Run `body`, a plain function of the values drawn from `strategies`
    (Hypothesis reads its signature), as @given(*strategies) within `budget`;
    `options` are further Hypothesis settings (deadline is always None)."""
    calls = 0

    @functools.wraps(body)
    def counted(*args: Any, **kwargs: Any) -> None:
        nonlocal calls
        calls += 1
        body(*args, **kwargs)

    def run_round(n: int) -> int:
        before = calls
        round_settings = settings(max_examples=n, deadline=None, **options)
        given(*strategies)(round_settings(_fresh(counted)))()
        return calls - before

    return run_rounds(budget, run_round)


def run_machine(budget: Budget, machine: type[RuleBasedStateMachine],
                **options: Any) -> Spent:
    """Run a rule-based state machine within `budget`, one case per machine
    instance; `options` are further Hypothesis settings (deadline is None)."""
    instances = 0

    class Counted(machine):  # type: ignore[valid-type, misc]
        def __init__(self) -> None:
            nonlocal instances
            instances += 1
            super().__init__()

    Counted.__name__ = Counted.__qualname__ = machine.__name__

    def run_round(n: int) -> int:
        before = instances
        run_state_machine_as_test(
            Counted, settings=settings(max_examples=n, deadline=None, **options))
        return instances - before

    return run_rounds(budget, run_round)


def _fresh(function: Callable[..., None]) -> Callable[..., None]:
    """A new function object per round: Hypothesis marks the ones it wraps."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> None:
        function(*args, **kwargs)

    return call
