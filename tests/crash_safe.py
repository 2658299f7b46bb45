"""A suite that fails instead of hanging: two pytest hooks, registered by tests/conftest.py (and
by `-p crash_safe` in tests/test_suite_guards.py's throwaway run).

- pytest-xdist's file-at-a-time scheduling, minus one way to hang: when a worker dies inside a
  test (a native crash, or the hard stop below), xdist 3.8 reports that test as failed, then hands
  the file's unfinished tests to the next worker *including the one that crashed*, which crashes
  it again; once the restarts allowed are spent, the file's other tests never run and the session
  waits for them forever. Here the crashed test counts as done (its failure is reported) and the
  rest of its file goes on, on another worker.
- pytest-timeout fails a test past its limit by a signal, which a test stuck in native code never
  sees. Under xdist such a test ends its worker HARD_STOP_GRACE_S later (its stacks dumped on
  stderr), which xdist reports as that test's crash; the run goes on and ends with a summary."""

import faulthandler
import os

import pytest
from xdist.scheduler import LoadFileScheduling

HARD_STOP_GRACE_S = float(os.environ.get("MTP_VIZ_HARD_STOP_GRACE_S", "60"))


class CrashSafeLoadFile(LoadFileScheduling):
    def remove_node(self, node) -> str | None:
        workload = self.assigned_work.pop(node)
        pending = [nodeid for unit in workload.values() for nodeid, done in unit.items() if not done]
        if not pending:
            return None
        crashed = pending[0]  # a unit's tests run in order: the first not done was running
        for unit in workload.values():
            if crashed in unit:
                unit[crashed] = True
        self.workqueue.update({scope: unit for scope, unit in workload.items() if not all(unit.values())})
        for other in self.assigned_work:
            self._reschedule(other)
        return crashed


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadfile":
        return CrashSafeLoadFile(config, log)
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    limit = _timeout(item)
    armed = bool(limit and os.environ.get("PYTEST_XDIST_WORKER"))
    if armed:
        faulthandler.dump_traceback_later(limit + HARD_STOP_GRACE_S, exit=True)
    try:
        yield
    finally:
        if armed:
            faulthandler.cancel_dump_traceback_later()


def _timeout(item) -> float:
    """pytest-timeout's limit for this test: its marker, else the run's option or ini value."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    return float(item.config.getoption("timeout", None) or item.config.getini("timeout") or 0)
