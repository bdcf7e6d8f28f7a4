"""`make vllm-compat VLLM=<version>`: does that vLLM release work with ec-daemon?

Run in the venv the target made (that vLLM's wheel over the CPU stack of
.venv-vllm), it checks that the venv holds the release asked for, that every
vLLM name ec_client uses is there and takes ec_client's arguments
(`ec_client.vllm_names`), then runs the connector suites (the pytest
arguments after `--`: no real engine, which needs a CPU build of vLLM), and
ends with one line: `vllm-compat: vLLM <version> works (...)` or
`vllm-compat: vLLM <version> broke: <what>`. Exit status 0 when it works.

    python -m tests.vllm.compat --version 0.34.0 -- tests/vllm/test_vllm_names.py ...
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

SHOWN = 5  # failing tests and missing names the line names; the rest are counted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", required=True, help="the vLLM release asked for")
    parser.add_argument("pytest_args", nargs="*", help="the connector suites, for pytest")
    args = parser.parse_args(argv)
    broke = installed_problems(args.version)
    if broke:  # (nothing else can be told of a venv without that release)
        print(verdict(args.version, broke))
        return 1
    from ec_client.vllm_names import problems

    names = problems()
    for problem in names:
        print(f"vllm-compat: missing or changed: {problem}")
    if names:
        broke.append(f"{len(names)} vLLM name(s) ec_client uses: {shown(names)}")
    ran, failed = run_suites(args.pytest_args)
    broke += failed
    print(verdict(args.version, broke, ran))
    return 1 if broke else 0


def installed_problems(version: str) -> list[str]:
    try:
        import vllm
    except Exception as error:  # (any import-time failure is the answer)
        return [f"`import vllm` fails: {error!r}"]
    if vllm.__version__ != version:
        return [f"this venv holds vLLM {vllm.__version__}, not {version}"]
    return []


def run_suites(pytest_args: list[str]) -> tuple[int, list[str]]:
    """Run pytest on `pytest_args`: the tests that ran, and what failed as
    the verdict says it."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.xml"
        status = subprocess.call([sys.executable, "-m", "pytest", *pytest_args,
                                  f"--junitxml={report}"])
        ran, failed = read_report(report) if report.exists() else (0, [])
    if failed:
        return ran, [f"{len(failed)} of {ran} tests failed: {shown(failed)}"]
    if status == 5 or ran == 0:
        return ran, ["the connector suites ran no test"]
    if status != 0:
        return ran, [f"pytest ended with status {status} (above)"]
    return ran, []


def read_report(report: Path) -> tuple[int, list[str]]:
    """Tests run (not skipped) and the ids of those that failed or errored."""
    ran, failed = 0, []
    for case in ET.parse(report).getroot().iter("testcase"):
        if case.find("skipped") is not None:
            continue
        ran += 1
        if case.find("failure") is not None or case.find("error") is not None:
            path = case.get("classname", "").replace(".", "/")
            failed.append(f"{path}.py::{case.get('name')}")
    return ran, failed


def shown(items: list[str]) -> str:
    rest = len(items) - SHOWN
    return "; ".join(items[:SHOWN]) + (f" (and {rest} more)" if rest > 0 else "")


def verdict(version: str, broke: list[str], ran: int = 0) -> str:
    if broke:
        return f"vllm-compat: vLLM {version} broke: {'; '.join(broke)}"
    return (f"vllm-compat: vLLM {version} works: every vLLM name ec_client uses is there, "
            f"and {ran} connector tests passed")


if __name__ == "__main__":
    sys.exit(main())
