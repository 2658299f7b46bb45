"""Measuring this machine from the app, as `python -m mtp_viz profile` and `tune` do: the
verify-cost curve and c of a model (cached per machine), and its linear plan again. Each runs as
a background job holding its models, with progress to show and a Stop that ends it."""

import json
from collections.abc import Callable, Iterator
from pathlib import Path

from mtp_viz.errors import UserError
from mtp_viz.kernel_plan import remeasure
from mtp_viz.linear_plan import BY_APP, Measurement, Stopped, describe_record
from mtp_viz.loading import load_model, model_name, retuned
from mtp_viz.machine import machine_key
from mtp_viz.paths import cache_root
from mtp_viz.profile import Cancelled, profile
from mtp_viz.registry import load_registry
from mtp_viz.ui import jobs

PROFILE_REPEATS = 3  # rounds of the in-app measurement (the CLI's profile takes --repeats)
PROFILE_MAX_K = 16


def machine_profile_path(model: str | None = None) -> Path:
    """Where this machine's measured profile of `model` (default: the device's) is cached."""
    name = model_name(model)
    return cache_root() / "profiles" / f"{machine_key()}-{Path(name).name}.json"


def measure_machine(model: str | None = None) -> Iterator[tuple[int, int, Path | None]]:
    """Measure the verify-cost curve and c on this machine for `model` (and its first registered
    draft), as `python -m mtp_viz profile` does: (rounds done, rounds, None) while it runs, then
    (rounds, rounds, path of the cached JSON). Closing the generator stops the measurement."""
    name = model_name(model)
    entry = load_registry().models.get(name)
    target = load_model(name)
    draft = load_model(entry.drafts[0]) if entry and entry.drafts else None
    state = {"done": 0}

    def measure(stopped: Callable[[], bool]):
        def progress(done: int, total: int) -> bool:
            state["done"] = done
            return stopped()

        with jobs.holding({target.name} | ({draft.name} if draft else set())):
            try:
                return profile(target, draft, PROFILE_MAX_K, PROFILE_REPEATS, progress=progress)
            except Cancelled:
                return None

    yield 0, PROFILE_REPEATS, None
    result = yield from jobs.in_background(measure, lambda: (state["done"], PROFILE_REPEATS, None))
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
    name = model_name(model)
    loaded = load_model(name)
    if loaded.device.type != "cpu" or loaded.dtype != "float32":
        raise UserError(f"{name} runs on {loaded.device.type} in {loaded.dtype}: linear plans are for float32 on a CPU")
    rounds = [0]

    def measure(stopped: Callable[[], bool]) -> Measurement | None:
        def counted() -> bool:  # asked once per round
            rounds[0] += 1
            return stopped()

        with jobs.holding({loaded.name}):
            try:
                result = remeasure(loaded.model, BY_APP, stopped=counted)
            except Stopped:
                return None
            retuned(loaded, BY_APP)  # what it cached (unless MTP_VIZ_LINEAR forces one), its row plans probed again
            return result

    result = yield from jobs.in_background(measure, lambda: f"Timing the linear kernels: round {rounds[0]}…")
    if result is not None:
        yield describe_record(result.record())
