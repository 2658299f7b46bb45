"""The suite fails instead of hanging (tests/crash_safe.py): in a throwaway run on two workers, a
test that kills its worker, a test that hangs, and a test that hangs deaf to pytest-timeout's
signal each fail by name; every other test still runs; the run ends with a summary; no process
is left behind."""

import contextlib
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from conftest import gone

TESTS = Path(__file__).resolve().parent
THROWAWAY = {
    "test_crash.py": """
        import os, signal
        def test_before_the_crash(): pass
        def test_dies_by_sigill(): os.kill(os.getpid(), signal.SIGILL)
        def test_after_the_crash(): pass
    """,
    "test_hang.py": """
        import signal, time
        def test_hangs(): time.sleep(3600)
        def test_hangs_deaf_to_the_timeout():
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(3600)
        def test_after_the_hangs(): pass
    """,
}


RUN_LIMIT_S = 240.0  # the throwaway run takes ~20 s; past this it hangs, which is the failure
WATCH_S = 0.2  # how often the run's process tree is looked at while it runs
EXIT_GRACE_S = 5.0  # a worker told to stop by the ending run may take a moment to go


@pytest.fixture
def started(tmp_path):
    """Every process the throwaway run starts, filled in while it runs; whatever the outcome, each
    one and anything still working in its folder is killed when the test ends."""
    processes: list[psutil.Process] = []
    yield processes
    kill(processes + in_folder(tmp_path))


@pytest.mark.slow
def test_a_crashing_and_a_hanging_test_fail_by_name_and_the_run_ends(tmp_path, started):
    for name, body in THROWAWAY.items():
        (tmp_path / name).write_text(textwrap.dedent(body))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not ours: only the plugin under test
    env = {**os.environ, "PYTHONPATH": str(TESTS), "MTP_VIZ_HARD_STOP_GRACE_S": "3"}
    env.pop("PYTEST_XDIST_WORKER", None)
    args = [sys.executable, "-m", "pytest", "-p", "crash_safe", "-n", "2", "--dist", "loadfile", "--timeout", "4"]
    out = run_watched(args, tmp_path, env, started)
    summary = out.strip().splitlines()[-1]
    assert "3 failed, 3 passed" in summary, out[-3000:]
    assert "FAILED test_crash.py::test_dies_by_sigill - worker 'gw" in out
    assert "FAILED test_hang.py::test_hangs - Failed: Timeout" in out
    assert "FAILED test_hang.py::test_hangs_deaf_to_the_timeout - worker 'gw" in out
    assert len(started) >= 2, started  # the workers at least: the watch saw them, so the next check can fail
    outlived = [p for p in started if not gone([p], timeout=EXIT_GRACE_S)]
    assert not outlived, [p.cmdline() for p in outlived]
    left = in_folder(tmp_path)
    assert not left, [p.cmdline() for p in left]  # workers run where the run was started


def run_watched(args: list[str], cwd: Path, env: dict, started: list[psutil.Process]) -> str:
    """Run `args` in `cwd` to its end and return its output, adding every process it starts to
    `started` as they are seen. Past RUN_LIMIT_S the run is killed and the test fails (the
    `started` fixture kills the rest of its tree)."""
    log = cwd / "run.log"
    with log.open("w") as sink:
        run = subprocess.Popen(args, cwd=cwd, env=env, stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + RUN_LIMIT_S
    try:
        while run.poll() is None:
            if time.monotonic() > deadline:
                pytest.fail(f"the throwaway run did not end in {RUN_LIMIT_S:.0f} s:\n{log.read_text()[-3000:]}")
            seen = {p.pid for p in started}
            started.extend(p for p in descendants(run.pid) if p.pid not in seen)
            time.sleep(WATCH_S)
    finally:
        run.kill()
        run.wait()
    return log.read_text()


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def in_folder(folder: Path) -> list[psutil.Process]:
    """The processes working in `folder` (the throwaway run's workers start there)."""
    return [p for p in psutil.process_iter(["cwd"]) if p.info["cwd"] == str(folder)]


def kill(processes: list[psutil.Process]) -> None:
    for p in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(processes, timeout=EXIT_GRACE_S)
