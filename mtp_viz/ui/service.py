"""What the UI callbacks call: run a request while holding its models, stream its steps, compare
strategies, measure this machine, and move traces in and out as files. No decoding logic and no
layout here: every long job runs through `in_background`, the UI only draws what it yields."""

import json
import os
import tempfile
import threading
from collections import defaultdict
from collections.abc import Callable, Generator, Iterator
from contextlib import ExitStack
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TypeVar

import pandas as pd

from mtp_viz.deploy import deploy_costs
from mtp_viz.errors import InvalidSettingsError, InvalidTraceError, UnknownModelError, UserError
from mtp_viz.kernels import use_fast_linears
from mtp_viz.linear_plan import BY_APP, Measurement, Stopped, describe_record, remeasure, tune
from mtp_viz.machine import machine_key
from mtp_viz.models import HUB_ID, load_model, resolve_device
from mtp_viz.paths import cache_root
from mtp_viz.profile import Cancelled, profile
from mtp_viz.quality import verdicts
from mtp_viz.registry import load_registry
from mtp_viz.row_plan import plan_rows
from mtp_viz.runner import Run, RunRequest, coerce, settings_of
from mtp_viz.serving.backend import run_vllm
from mtp_viz.strategies import get_strategy
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.trace import Step, Trace
from mtp_viz.viz.tables import metrics_table
from mtp_viz.weights import AUTO

MAX_TRACE_BYTES = 8 * 1024 * 1024  # uploads above this are refused
MAX_COMPARED = 4  # runs side by side in a comparison: autoregressive + 3 others
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

    trace = yield from in_background(decode, lambda: (list(steps), None) if steps else None)
    yield trace.steps, trace


def stream_vllm(request: RunRequest) -> Iterator[tuple[str, Trace | None]]:
    """(what the vLLM server is doing, None) while it starts and answers, then ("", trace). The
    server is started for this run and stopped after it; closing the generator (Stop) stops it
    at once while it starts, else after the request in flight."""
    status = {"message": "starting a vLLM server"}

    def serve(stopped: Callable[[], bool]) -> Trace:
        return run_vllm(request, progress=lambda m: status.update(message=m), cancelled=stopped)

    trace = yield from in_background(serve, lambda: (status["message"], None))
    yield "", trace


def run_to_end(request: RunRequest) -> Trace:
    *_, (_, trace) = stream(request)
    return trace


def comparison_requests(strategies: list[str], **values) -> list[RunRequest]:
    """Autoregressive first, then the chosen strategies, all with the same prompt and settings."""
    chosen = ["autoregressive"] + [s for s in dict.fromkeys(strategies) if s != "autoregressive"]
    if len(chosen) > MAX_COMPARED:
        raise UserError(f"compare at most {MAX_COMPARED - 1} strategies beside autoregressive")
    if len(chosen) < 2:
        raise UserError("pick at least one strategy to compare with autoregressive")
    return [build_request(strategy=s, **values) for s in chosen]


@dataclass(frozen=True)
class Comparison:
    """Runs of one prompt side by side, autoregressive first: their metrics and verdicts."""

    traces: list[Trace]
    metrics: pd.DataFrame  # viz.tables.metrics_table, speedups over the first run
    verdicts: dict[str, str]  # strategy → quality.verdicts' line


def comparison(traces: list[Trace], live: bool = True) -> Comparison:
    """Live runs also get what each strategy costs to deploy (from the models they just loaded);
    uploaded traces do not, so that opening one never loads, let alone downloads, a model."""
    costs = deploy_costs(traces) if live else None
    return Comparison(traces, metrics_table(traces, baseline=traces[0], costs=costs), verdicts(traces))


def compare(strategies: list[str], **values) -> Iterator[tuple[str, list[Trace], Comparison | None]]:
    """Autoregressive, then each chosen strategy, on one prompt and settings (`values`: as
    build_request takes them): (what is running, the traces so far, None) while they run, then
    ("", all traces, their Comparison). Closing it cancels the run in flight within one step."""
    requests = comparison_requests(strategies, **values)
    traces: list[Trace] = []
    for r in requests:
        for steps, trace in stream(r):
            if trace is None:
                yield f"{r.strategy}: step {len(steps)}…", list(traces), None
        traces.append(trace)
        yield f"finished {len(traces)} of {len(requests)}…", list(traces), None
    yield "", traces, comparison(traces)


def uploaded_comparison(paths: list[str] | None) -> list[Trace]:
    """Uploaded traces, the autoregressive one first as the baseline."""
    traces = [read_uploaded_trace(p) for p in paths or []]
    if not 2 <= len(traces) <= MAX_COMPARED:
        raise UserError(f"upload 2 to {MAX_COMPARED} traces, one of them autoregressive")
    traces.sort(key=lambda t: t.strategy != "autoregressive")
    if traces[0].strategy != "autoregressive":
        raise UserError("one of the uploaded traces must be an autoregressive run: it is the baseline")
    if len({tuple(t.prompt_token_ids) for t in traces}) > 1:
        raise UserError("the uploaded traces are of different prompts; compare runs of one prompt")
    return traces


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


def _as_number(name: str, value, kind: type):
    """A UI value as an int or a float: whole numbers arrive as floats (12.0), numbers as text;
    anything else is left to the settings' own checks."""
    what = "a whole number" if kind is int else "a number"
    if isinstance(value, str):
        try:
            return kind(value)
        except ValueError:
            raise InvalidSettingsError(f"{name} must be {what}, got {value!r}") from None
    if kind is int and isinstance(value, float):
        if not value.is_integer():
            raise InvalidSettingsError(f"{name} must be {what}, got {value}")
        return int(value)
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


# The app's generation defaults: GenerationSettings' own, but shorter answers than the CLI's.
APP_GENERATION = {**asdict(GenerationSettings()), "max_new_tokens": 64}


def build_request(
    prompt: str,
    model: str | None,
    strategy: str,
    draft: str | None = None,
    raw: bool = False,
    settings: dict | None = None,
    compile: str = "auto",
    weights: str = AUTO,
    **values,
) -> RunRequest:
    """UI values (numbers arrive as floats, empty choices as "" or None) → a validated RunRequest.

    `values` holds generation settings by GenerationSettings' names (APP_GENERATION where absent)
    and strategy settings from controls shared by every strategy (one per setting name), of which
    only the chosen strategy's are kept. The `settings` dict names strategy settings on purpose:
    one the strategy does not have is an error. Values are converted to the setting's type."""
    spec = get_strategy(strategy)
    settings = parse_settings(settings)
    generation = {k: values.pop(k) for k in APP_GENERATION if k in values}
    chosen = {**settings_of(strategy, values), **{k: v for k, v in settings.items() if v is not None}}
    strategy_settings = {k: coerce(strategy, k, v) for k, v in chosen.items()}
    kinds = {f.name: type(f.default) for f in fields(GenerationSettings)}
    generation = {k: _as_number(k, v, kinds[k]) for k, v in {**APP_GENERATION, **generation}.items()}
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
        generation=GenerationSettings(**generation),
        strategy_settings=strategy_settings,
        compile=compile or "auto",
        weights=weights or AUTO,
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
    name = model or load_registry().default_for(resolve_device().type)
    return cache_root() / "profiles" / f"{machine_key()}-{Path(name).name}.json"


def measure_machine(model: str | None = None) -> Iterator[tuple[int, int, Path | None]]:
    """Measure the verify-cost curve and c on this machine for `model` (and its first registered
    draft), as `python -m mtp_viz profile` does: (rounds done, rounds, None) while it runs, then
    (rounds, rounds, path of the cached JSON). Closing the generator stops the measurement."""
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
    result = yield from in_background(measure, lambda: (state["done"], PROFILE_REPEATS, None))
    if result is None:  # stopped
        return
    path = machine_profile_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.as_dict(), indent=1))
    yield PROFILE_REPEATS, PROFILE_REPEATS, path


def remeasure_linear_plan(model: str | None = None) -> Iterator[str]:
    """Measure the linear plan of `model` (default: the device's) again, as `python -m mtp_viz tune`
    does, while no run uses the model: progress lines while it runs, then the plan in one line; the
    loaded model runs the new plan from then on. Closing the generator stops it (nothing cached)."""
    name = model or load_registry().default_for(resolve_device().type)
    loaded = load_model(name)
    if loaded.device.type != "cpu" or loaded.dtype != "float32":
        raise UserError(f"{name} runs on {loaded.device.type} in {loaded.dtype}: linear plans are for float32 on a CPU")
    rounds = [0]

    def measure(stopped: Callable[[], bool]) -> Measurement | None:
        def counted() -> bool:  # asked once per round
            rounds[0] += 1
            return stopped()

        with _holding({loaded.name}):
            try:
                result = remeasure(loaded.model, BY_APP, stopped=counted)
            except Stopped:
                return None
            use_fast_linears(loaded.model, tune(loaded.model))  # what it cached, unless MTP_VIZ_LINEAR forces one
            plan_rows(loaded.model, BY_APP)  # the fp32 row plan was probed on the old path: again on this one
            return result

    result = yield from in_background(measure, lambda: f"Timing the linear kernels: round {rounds[0]}…")
    if result is not None:
        yield describe_record(result.record())
