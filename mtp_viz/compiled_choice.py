"""Compiled by default where it pays, without a cold start in front of the user (`compile=auto`).

On a GPU, auto compiles (CUDA graphs). On a CPU the compiled engine is mtp_viz.static's layer graph,
built once per machine and model shape (about a minute on 2 cores) and then loaded in seconds, and
it is used where it measured faster than the eager forward here:

- a model whose compiled layer is built and whose choice is recorded runs as the record says;
- built but not yet measured: one short measurement (eager and compiled, interleaved: one-token
  and 4-row forwards on a scratch cache, ~1-2 s), recorded per machine and model shape
  (cache_root()/compiled/), then as it says;
- not built: the CLI builds it in the foreground, saying so; the app starts the build in a process
  of its own at low priority and serves the eager engine until it is ready (its next run measures
  and uses it).
What a process does is set once (`allow_builds`): a library caller, the tests among them, leaves it
at NONE and auto runs eager on a CPU, so a run never depends on a build or a record left behind.
`describe` says which of these happened, for the trace's machine line.
"""

import atexit
import json
import logging
import statistics
import subprocess
import sys
import time
from dataclasses import asdict

import torch

from mtp_viz import measured, static
from mtp_viz.cache import CachedModel
from mtp_viz.child import exit_reason
from mtp_viz.lean import compile_unavailable

log = logging.getLogger(__name__)

NONE, FOREGROUND, BACKGROUND = "none", "foreground", "background"  # builds this process allows
RECORD_VERSION = 1
FOLDER = "compiled"
ROUNDS, TOKENS, VERIFY_ROWS = 3, 6, 4

_builds = NONE
_building: dict[str, subprocess.Popen] = {}  # config key → its build process (BACKGROUND)


def allow_builds(mode: str) -> None:
    """What `compile=auto` may do on a CPU when a model's compiled layer is not built yet."""
    global _builds
    _builds = mode


def record_path(config: static.LayerConfig, layers: int):
    return measured.record_path(FOLDER, config.key(), f"{layers}l", prefix="choice-")


def choose(lean, model) -> tuple[bool, str]:
    """Whether `lean` (the lean view of `model`) runs compiled under auto on a CPU, and why, in
    words; compiled (its package loaded) when it does. CompileUnavailable where it cannot."""
    if _builds == NONE:
        return False, "auto: eager (compiled where a CLI or app process measured it faster: compile=on compiles)"
    if reason := compile_unavailable(lean.device):
        return False, f"auto: {reason}"
    packed = static.pack(lean)
    if isinstance(packed, str):
        return False, f"auto: not compiled ({packed})"
    config, layers = packed
    path = record_path(config, len(layers))
    record = measured.read(path, RECORD_VERSION, ("compiled", "eager_ms", "compiled_ms"))
    if record is not None and not measured.still_good(record, time.time()):
        record = None  # noisy when measured: measured again
    if not static.ready(config):
        if _builds == BACKGROUND:
            return False, start_background_build(config)
        log.warning("building the compiled engine for this machine once (about a minute; later starts load it)")
    build_adapted = _builds != BACKGROUND  # in the app: built beside, used once there (a mask-token view)
    adapted = static.pack(lean, adapted=True) if not build_adapted and lean.adapted is not None else None
    if isinstance(adapted, tuple) and not static.ready(adapted[0]):
        start_background_build(adapted[0])
    if record is None:
        lean.compile(build_adapted)
        record = measure(lean, model)
        measured.write(path, record, what="the compiled-or-eager choice")
    if record["compiled"]:
        lean.compile(build_adapted)
    return record["compiled"], describe(record)


def start_background_build(config: static.LayerConfig) -> str:
    """The build of `config`'s layer in a process of its own, started once per process and config."""
    key = config.key()
    if key not in _building:
        _building[key] = subprocess.Popen(build_command(config), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        atexit.register(stop_builds)
    process = _building[key]
    if process.poll() is None:
        return "auto: the compiled engine for this machine is being built in the background (about a minute)"
    return f"auto: the background build of the compiled engine {exit_reason(process.returncode)}"


def build_command(config: static.LayerConfig) -> list[str]:
    """The build process's command: the config, and this process's threads (the package is keyed by them)."""
    return [sys.executable, "-m", "mtp_viz.static", json.dumps(asdict(config)), str(torch.get_num_threads())]


def stop_builds() -> None:
    """Stop the background builds still running (the app's exit)."""
    for process in _building.values():
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=10)
    _building.clear()


@torch.inference_mode()
def measure(lean, model) -> dict:
    """Eager against compiled here: the median over ROUNDS interleaved rounds of TOKENS one-token
    forwards and one VERIFY_ROWS-row forward on a scratch cache, in ms."""
    times: dict[bool, list[float]] = {False: [], True: []}
    ids = [(3 + i) % model.config.vocab_size for i in range(TOKENS + VERIFY_ROWS + 2)]  # any vocabulary's ids
    for _ in range(ROUNDS):
        for compiled in (False, True):
            lean.compiled = compiled
            cached = CachedModel(model)
            cached.forward(ids[:2])
            began = time.perf_counter()
            for end in range(3, 3 + TOKENS):
                cached.forward(ids[:end])  # one new token
            cached.forward(ids)  # VERIFY_ROWS new rows
            times[compiled].append((time.perf_counter() - began) * 1e3)
    eager, compiled = statistics.median(times[False]), statistics.median(times[True])
    lean.compiled = True
    spread = max(max(v) / min(v) for v in times.values())
    return {
        "version": RECORD_VERSION,
        "compiled": compiled < eager,
        "eager_ms": round(eager, 2),
        "compiled_ms": round(compiled, 2),
        "what": f"{TOKENS} one-token forwards and one {VERIFY_ROWS}-row forward, median of {ROUNDS}",
        "settled": spread < 1.5,
        measured.MEASURED_AT: measured.stamp(time.time()),
        "load_average": measured.load_average(),
    }


def describe(record: dict) -> str:
    ratio = record["eager_ms"] / record["compiled_ms"]
    return f"auto: compiled ran {ratio:.2f}x eager's speed here (measured {record[measured.MEASURED_AT][:10]})"
