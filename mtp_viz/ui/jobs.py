"""Long work off the UI's thread: a job runs in its own thread while the UI polls it for something
to draw, Stop winds it down, and one job at a time holds a model (jobs on different models run in
parallel)."""

import threading
from collections import defaultdict
from collections.abc import Callable, Generator
from contextlib import ExitStack
from typing import TypeVar

STREAM_INTERVAL_S = 0.25  # the UI redraws this often while a job runs
T = TypeVar("T")  # what a background job returns
P = TypeVar("P")  # what it reports while it runs

# One job per model at a time: runs on different models proceed in parallel.
_model_locks: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)
_locks_guard = threading.Lock()


def lock_for(name: str) -> threading.Lock:
    """The lock a job holds while it uses the model `name`."""
    with _locks_guard:
        return _model_locks[name]


def holding(names: set[str]) -> ExitStack:
    """The locks of these models, taken in sorted order (two jobs never wait on each other in a cycle)."""
    stack = ExitStack()
    for name in sorted(names):
        stack.enter_context(lock_for(name))
    return stack


def in_background(work: Callable[[Callable[[], bool]], T], poll: Callable[[], P | None]) -> Generator[P, None, T]:
    """Run `work(stopped)` in its own thread, so the UI never pauses it: yield `poll()` every
    STREAM_INTERVAL_S while it runs (None: nothing new to show), and return its result
    (`result = yield from in_background(...)`). Closing the generator (Gradio does when Stop is
    pressed) makes `stopped()` true and waits for the work to wind down; its error, if any, is
    raised here."""
    stop = threading.Event()
    result: list = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(work(stop.is_set))
        except BaseException as e:  # handed to the caller's thread
            errors.append(e)

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(STREAM_INTERVAL_S)
            if worker.is_alive() and (update := poll()) is not None:
                yield update
    finally:
        stop.set()
        worker.join()
    if errors:
        raise errors[0]
    return result[0]
