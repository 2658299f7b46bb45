"""The suite fails instead of hanging (tests/crash_safe.py): in a throwaway run on two workers, a
test that kills its worker, a test that hangs, and a test that hangs deaf to pytest-timeout's
signal each fail by name; every other test still runs; the run ends with a summary; no process
is left behind."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

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


@pytest.mark.slow
def test_a_crashing_and_a_hanging_test_fail_by_name_and_the_run_ends(tmp_path):
    for name, body in THROWAWAY.items():
        (tmp_path / name).write_text(textwrap.dedent(body))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not ours: only the plugin under test
    env = {**os.environ, "PYTHONPATH": str(TESTS), "MTP_VIZ_HARD_STOP_GRACE_S": "3"}
    env.pop("PYTEST_XDIST_WORKER", None)
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "crash_safe", "-n", "2", "--dist", "loadfile", "--timeout", "4"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = run.communicate(timeout=240)
    finally:
        workers = psutil.Process(run.pid).children(recursive=True) if run.poll() is None else []
        run.kill()
    summary = out.strip().splitlines()[-1]
    assert "3 failed, 3 passed" in summary, out[-3000:]
    assert "FAILED test_crash.py::test_dies_by_sigill - worker 'gw" in out
    assert "FAILED test_hang.py::test_hangs - Failed: Timeout" in out
    assert "FAILED test_hang.py::test_hangs_deaf_to_the_timeout - worker 'gw" in out
    assert not workers
    left = [p for p in psutil.process_iter(["cwd", "cmdline"]) if p.info["cwd"] == str(tmp_path)]
    assert not left, [p.info["cmdline"] for p in left]  # workers run where the run was started
