"""Child processes that never outlive us, and one line for how a child ended.

Native engines (a vLLM server, llama.cpp) run in child processes: a crash there is theirs, not
ours. But a child outlives a parent that is killed with SIGKILL (nothing in the parent runs
then), so each child watches its parent itself:

- a worker we wrote (mtp_viz.llama_worker) calls `exit_with_parent()`: a thread polls the parent
  id and ends the process once the parent is gone (ctypes calls release the GIL, so the thread
  runs while the worker is inside a native call);
- a program we did not write (the vLLM server) runs under the guard, `guarded(command)`: this
  module run as a script, which starts the command in its own process group beside it and stops
  that group (SIGTERM, then SIGKILL after a grace) when the parent is gone or when it is itself
  told to terminate.

Standard library only: the guard starts in a fraction of a second, before anything heavy loads.
"""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

POLL_S = 0.5  # how often a child looks for its parent
GRACE_S = 15.0  # between SIGTERM and SIGKILL when the guard stops its command


def exit_reason(returncode: int | None) -> str:
    """How a child ended, in words: "exited with status 1", "killed by SIGILL (illegal instruction)"."""
    if returncode is None:
        return "is still running"
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        sig = signal.Signals(-returncode)
    except ValueError:
        return f"was killed by signal {-returncode}"
    return f"was killed by {sig.name} ({signal.strsignal(sig).lower()})"


def exit_with_parent(on_gone=lambda: os._exit(1), poll_s: float = POLL_S) -> threading.Thread:
    """In a child: end this process (or call `on_gone`) once the process that started it is gone."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        on_gone()

    thread = threading.Thread(target=watch, name="exit-with-parent", daemon=True)
    thread.start()
    return thread


def guarded(command: list[str]) -> list[str]:
    """`command` run under the guard: start the result with `start_new_session=True`, so that
    stopping its process group stops the command and everything the command started."""
    return [sys.executable, str(Path(__file__).resolve()), *command]


def _guard(command: list[str], grace_s: float = GRACE_S) -> int:
    child = subprocess.Popen(command)  # in our process group (the caller started us in a new one)
    stop = threading.Event()  # set when our parent is gone, or when we are told to terminate
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    exit_with_parent(on_gone=stop.set)
    while child.poll() is None and not stop.wait(POLL_S):
        pass
    if stop.is_set():  # SIGTERM the group (the command and what it started), SIGKILL what is left
        os.killpg(0, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(grace_s)
        os.killpg(0, signal.SIGKILL)
    returncode = child.wait()
    if returncode < 0:  # end as the command did, so our parent reads the same cause
        signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
    return returncode


if __name__ == "__main__":
    sys.exit(_guard(sys.argv[1:]))
