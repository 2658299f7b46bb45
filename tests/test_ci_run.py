""".ci/run is green only when the tests ran and passed: in a throwaway copy of the repository whose
set-up script, python and ruff are stand-ins that record each call, a set-up step that fails ends
the run with a failure before pytest, pytest's failure fails the run, and with every step passing
the README's whole test command runs, then ruff."""

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SETUP = """#!/bin/sh
echo "setup ${1:-plain}" >> "$CI_CALLS"
[ "${1:-plain}" != "${FAIL_SETUP:-none}" ]
"""
PYTHON = """#!/bin/sh
echo "python $*" >> "$CI_CALLS"
exit "${PYTEST_STATUS:-0}"
"""
RUFF = """#!/bin/sh
echo "ruff $*" >> "$CI_CALLS"
"""
SET_UP = ["setup plain", "setup --vllm", "setup --llama", "setup --browser"]  # the README's steps, in order
PYTEST = "python -m pytest"
RUFF_CALLS = ["ruff check .", "ruff format --check ."]


def ci_run(tmp_path: Path, **env: str) -> tuple[int, list[str]]:
    """Run the real .ci/run and README.md in a copy whose tools only record their calls."""
    for name, body in {"scripts/setup.sh": SETUP, ".venv/bin/python": PYTHON, ".venv/bin/ruff": RUFF}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(body)
        (tmp_path / name).chmod(0o755)
    (tmp_path / ".ci").mkdir(exist_ok=True)
    shutil.copy(REPO / ".ci" / "run", tmp_path / ".ci" / "run")
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    calls = tmp_path / "calls.log"
    calls.unlink(missing_ok=True)
    done = subprocess.run(
        ["bash", str(tmp_path / ".ci" / "run")],
        env={**os.environ, "CI_CALLS": str(calls), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, calls.read_text().splitlines() if calls.is_file() else []


def test_a_failing_set_up_step_fails_the_run_before_pytest(tmp_path):
    status, calls = ci_run(tmp_path, FAIL_SETUP="--vllm")
    assert status != 0
    assert calls == SET_UP[:2], calls  # stopped at the failing step: neither pytest nor ruff ran


def test_a_failing_pytest_fails_the_run(tmp_path):
    status, calls = ci_run(tmp_path, PYTEST_STATUS="1")
    assert status != 0
    assert calls == [*SET_UP, PYTEST], calls


def test_with_every_step_passing_the_readmes_command_runs_then_ruff(tmp_path):
    status, calls = ci_run(tmp_path)
    assert status == 0
    assert calls == [*SET_UP, PYTEST, *RUFF_CALLS], calls
