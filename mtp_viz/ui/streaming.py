"""One run as the UI sees it: its steps streamed while it decodes (on our engine, holding its
models) or the serving engine's progress while it starts and answers, then its trace."""

from collections.abc import Callable, Iterator

from mtp_viz.runner import Run, RunRequest
from mtp_viz.serving import pool
from mtp_viz.serving.backend import run_vllm
from mtp_viz.trace import Step, Trace
from mtp_viz.ui import jobs


def stream(request: RunRequest) -> Iterator[tuple[list[Step], Trace | None]]:
    """(steps so far, None) while decoding runs (when there are any), then (all steps, trace).
    Closing this generator cancels the run within one step."""
    run = Run(request)  # validation errors surface here, before any thread starts
    steps: list[Step] = []

    def decode(stopped: Callable[[], bool]) -> Trace:
        with jobs.holding({run.target.name} | ({run.draft.name} if run.draft else set())):
            for step in run.steps():
                steps.append(step)
                if stopped():
                    run.cancel()
        return run.trace

    trace = yield from jobs.in_background(decode, lambda: (list(steps), None) if steps else None)
    yield trace.steps, trace


def stream_vllm(request: RunRequest) -> Iterator[tuple[str, Trace | None]]:
    """(what the vLLM server is doing, None) while it starts and answers, then ("", trace). The
    server comes from the process's pool: started on the first run of its configuration and kept
    for the next ones (mtp_viz.serving.pool). Closing the generator (Stop) gives up at once while
    the server starts or the run waits its turn (a server stopped while starting is not kept),
    else after the request in flight."""
    status = {"message": "preparing the vLLM run"}

    def serve(stopped: Callable[[], bool]) -> Trace:
        return run_vllm(request, progress=lambda m: status.update(message=m), cancelled=stopped, pool=pool.shared())

    trace = yield from jobs.in_background(serve, lambda: (status["message"], None))
    yield "", trace


def run_to_end(request: RunRequest) -> Trace:
    *_, (_, trace) = stream(request)
    return trace
