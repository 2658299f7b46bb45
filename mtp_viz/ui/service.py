"""What the UI callbacks call: run a request while holding its models, stream its steps, and move
traces in and out as files. No decoding logic and no layout here."""

import json
import os
import tempfile
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from mtp_viz.errors import InvalidSettingsError, InvalidTraceError, UnknownModelError
from mtp_viz.models import HUB_ID
from mtp_viz.registry import load_registry
from mtp_viz.runner import Run, RunRequest, coerce, settings_of
from mtp_viz.strategies import get_strategy
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.trace import Step, Trace

MAX_TRACE_BYTES = 8 * 1024 * 1024  # uploads above this are refused
ANY_MODEL_ENV = "MTP_VIZ_ALLOW_ANY_MODEL"  # 1: the app may load hub ids beyond the registry
STREAM_INTERVAL_S = 0.25  # the UI redraws this often while a run streams
T = TypeVar("T")  # what a background job returns
P = TypeVar("P")  # what it reports while it runs

# One decoding job per model at a time: runs on different models proceed in parallel.
_model_locks: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)
_locks_guard = threading.Lock()


def _lock_for(name: str) -> threading.Lock:
    with _locks_guard:
        return _model_locks[name]


def in_background(work: Callable[[Callable[[], bool]], T], poll: Callable[[], P]) -> Iterator[P | T]:
    """Run `work(stopped)` in its own thread, so the UI never pauses it: yield `poll()` every
    STREAM_INTERVAL_S while it runs, then its result. Closing the generator (Gradio does when
    Stop is pressed) makes `stopped()` true and waits for the work to wind down; its error, if
    any, is raised here."""
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
            if worker.is_alive():
                yield poll()
    finally:
        stop.set()
        worker.join()
    if errors:
        raise errors[0]
    yield result[0]


def _holding(names: set[str]) -> ExitStack:
    """The locks of these models, taken in sorted order (two jobs never wait on each other in a cycle)."""
    stack = ExitStack()
    for name in sorted(names):
        stack.enter_context(_lock_for(name))
    return stack


def stream(request: RunRequest) -> Iterator[tuple[list[Step], Trace | None]]:
    """(steps so far, None) while decoding runs (when there are any), then (all steps, trace).
    Closing this generator cancels the run within one step."""
    run = Run(request)  # validation errors surface here, before any thread starts
    steps: list[Step] = []

    def decode(stopped: Callable[[], bool]) -> Trace:
        with _holding({run.target.name} | ({run.draft.name} if run.draft else set())):
            for step in run.steps():
                steps.append(step)
                if stopped():
                    run.cancel()
        return run.trace

    for update in in_background(decode, lambda: list(steps)):
        if isinstance(update, Trace):
            yield update.steps, update
        elif update:
            yield update, None


def stream_vllm(request: RunRequest) -> Iterator[tuple[str, Trace | None]]:
    """(what the vLLM server is doing, None) while it starts and answers, then ("", trace). The
    server is started for this run and stopped after it; closing the generator (Stop) stops it
    at once while it starts, else after the request in flight."""
    from mtp_viz.serving.backend import run_vllm

    status = {"message": "starting a vLLM server"}

    def serve(stopped: Callable[[], bool]) -> Trace:
        return run_vllm(request, progress=lambda m: status.update(message=m), cancelled=stopped)

    for update in in_background(serve, lambda: status["message"]):
        yield ("", update) if isinstance(update, Trace) else (update, None)


def run_to_end(request: RunRequest) -> Trace:
    *_, (_, trace) = stream(request)
    return trace


def trace_file(trace: Trace) -> str:
    """Write a trace to a fresh temporary file for download; the name is ours, never the user's."""
    folder = Path(tempfile.mkdtemp(prefix="mtp-viz-"))
    path = folder / f"trace-{trace.strategy}-{trace.model}.json".replace("/", "_")
    trace.save(path)
    return str(path)


def read_uploaded_trace(path: str | None) -> Trace:
    """Validate an uploaded trace file (size first, then JSON and schema)."""
    if not path:
        raise InvalidTraceError("no file was uploaded")
    size = Path(path).stat().st_size
    if size > MAX_TRACE_BYTES:
        raise InvalidTraceError(f"the file has {size:,} bytes; traces up to {MAX_TRACE_BYTES:,} bytes are accepted")
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidTraceError("the file is not UTF-8 text") from None
    return Trace.from_json(text)


def model_allowed(name: str) -> bool:
    """The app loads registered models only: a user's string never becomes a path on this disk.
    With ANY_MODEL_ENV=1 other Hugging Face hub ids are allowed too (still never a local path)."""
    if name in load_registry().models:
        return True
    allow = os.environ.get(ANY_MODEL_ENV, "") not in ("", "0", "false", "False")
    return allow and HUB_ID.fullmatch(name) is not None and not Path(name).exists()


def _as_int(name: str, value) -> int:
    if isinstance(value, float):
        if not value.is_integer():
            raise InvalidSettingsError(f"{name} must be a whole number, got {value}")
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            raise InvalidSettingsError(f"{name} must be a whole number, got {value!r}") from None
    return value


def _as_float(name: str, value) -> float:
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise InvalidSettingsError(f"{name} must be a number, got {value!r}") from None
    return value


def parse_settings(settings: dict | str | None) -> dict:
    """Strategy settings as given to the API: a dict, its JSON text, or nothing."""
    if isinstance(settings, str):
        try:
            settings = json.loads(settings) if settings.strip() else {}
        except json.JSONDecodeError:
            raise InvalidSettingsError("settings must be a JSON object of strategy settings") from None
    if not isinstance(settings or {}, dict):
        raise InvalidSettingsError("settings must be a JSON object of strategy settings")
    return dict(settings or {})


def build_request(
    prompt: str,
    model: str | None,
    strategy: str,
    draft: str | None = None,
    max_new_tokens: float = 64,
    temperature: float = 0.0,
    top_k: float = 0,
    top_p: float = 1.0,
    seed: float = 0,
    raw: bool = False,
    settings: dict | None = None,
    compile: str = "auto",
    **setting_values,
) -> RunRequest:
    """UI values (numbers arrive as floats, empty choices as "" or None) → a validated RunRequest.

    Strategy settings come as keywords from controls shared by every strategy (one per setting
    name), of which only the chosen strategy's are kept, and/or as the `settings` dict, which
    names settings on purpose: one the strategy does not have is an error. Values are converted
    to the setting's type."""
    spec = get_strategy(strategy)
    settings = parse_settings(settings)
    chosen = {**settings_of(strategy, setting_values), **{k: v for k, v in settings.items() if v is not None}}
    strategy_settings = {k: coerce(strategy, k, v) for k, v in chosen.items()}
    generation = GenerationSettings(
        max_new_tokens=_as_int("max_new_tokens", max_new_tokens),
        temperature=_as_float("temperature", temperature),
        top_k=_as_int("top_k", top_k),
        top_p=_as_float("top_p", top_p),
        seed=_as_int("seed", seed),
    )
    draft = (draft or None) if spec.needs_draft else None
    for name in (model, draft):
        if name and not model_allowed(name):
            raise UnknownModelError(
                f"unknown model {name!r}: the app loads the models in its registry "
                f"({', '.join(load_registry().models)}); set {ANY_MODEL_ENV}=1 to allow other hub ids"
            )
    return RunRequest(
        prompt=prompt,
        model=model or None,
        strategy=strategy,
        draft=draft,
        raw=bool(raw),
        generation=generation,
        strategy_settings=strategy_settings,
        compile=compile or "auto",
    )


OURS = "mtp-viz"  # the engine of a trace without one named (ours)
_KEYS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")  # generation settings a baseline shares


def as_baseline(request: RunRequest) -> RunRequest:
    """The autoregressive run that a request's speedup is measured against: same model, prompt,
    generation settings, device and compilation."""
    return replace(request, strategy="autoregressive", draft=None, heads=None, strategy_settings={})


def request_baseline_key(request: RunRequest) -> str:
    """`baseline_key` of the trace this request's autoregressive baseline would produce."""
    run = Run(as_baseline(request))
    g = request.generation
    settings = [g.max_new_tokens, g.temperature, g.top_k, g.top_p, g.seed]
    return json.dumps(
        [run.target.name, str(run.target.device), run.prompt_ids, dict(zip(_KEYS, settings, strict=True)), OURS]
    )


def baseline_key(trace: Trace) -> str:
    """Runs with the same model, prompt, generation settings and engine share an autoregressive baseline."""
    g = {k: trace.settings.get(k) for k in _KEYS}
    return json.dumps([trace.model, trace.device, trace.prompt_token_ids, g, trace.machine.get("engine", OURS)])


PROFILE_REPEATS = 3  # rounds of the in-app measurement (the CLI's profile takes --repeats)
PROFILE_MAX_K = 16


def machine_profile_path(model: str | None = None) -> Path:
    """Where this machine's measured profile of `model` (default: the device's) is cached."""
    from mtp_viz.machine import machine_key
    from mtp_viz.models import cache_root, resolve_device

    name = model or load_registry().default_for(resolve_device().type)
    return cache_root() / "profiles" / f"{machine_key()}-{Path(name).name}.json"


def measure_machine(model: str | None = None) -> Iterator[tuple[int, int, Path | None]]:
    """Measure the verify-cost curve and c on this machine for `model` (and its first registered
    draft), as `python -m mtp_viz profile` does: (rounds done, rounds, None) while it runs, then
    (rounds, rounds, path of the cached JSON). Closing the generator stops the measurement."""
    from mtp_viz.models import load_model, resolve_device
    from mtp_viz.profile import Cancelled, profile

    registry = load_registry()
    name = model or registry.default_for(resolve_device().type)
    entry = registry.models.get(name)
    target = load_model(name)
    draft = load_model(entry.drafts[0]) if entry and entry.drafts else None
    state = {"done": 0}

    def measure(stopped: Callable[[], bool]):
        def progress(done: int, total: int) -> bool:
            state["done"] = done
            return stopped()

        with _holding({target.name} | ({draft.name} if draft else set())):
            try:
                return profile(target, draft, PROFILE_MAX_K, PROFILE_REPEATS, progress=progress)
            except Cancelled:
                return None

    yield 0, PROFILE_REPEATS, None
    result = None
    for update in in_background(measure, lambda: (state["done"], PROFILE_REPEATS, None)):
        if isinstance(update, tuple):
            yield update
        else:
            result = update
    if result is None:  # stopped
        return
    path = machine_profile_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.as_dict(), indent=1))
    yield PROFILE_REPEATS, PROFILE_REPEATS, path
