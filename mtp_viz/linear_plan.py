"""The linear plan (mtp_viz.kernels) for a model on this machine: measured so that a busy machine
cannot decide it, with how it was measured (mtp_viz.kernel_plan reads, applies and records it).

On first load `measure_plan` times both ways on the model's own weight shapes, for every row count in
MEASURED_ROWS (a bucket), in rounds: each round times every bucket both ways back to back, so the
machine's drift hits both alike. The fast way is chosen only where it wins clearly (by MARGIN in
the median, in most rounds). A bucket whose rounds disagree (spread beyond MAX_SPREAD: another job
used the CPU) is measured again, at most RETRIES times (none when most buckets are noisy: a busy
machine); still noisy, it decides nothing (stock for its rows), and the plan serves only
RETRY_AFTER_S before a load measures it again. Plans are cached with when, by what and under what
load they were measured (a record without that is not trusted: `valid_record`), keyed by the
machine (CPU model and flags, threads, torch, BLAS: mtp_viz.machine) and the weight shapes, so
later loads pay nothing. `python -m mtp_viz tune` and the Theory tab measure again.
"""

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from mtp_viz import measured
from mtp_viz.kernels import FAST, MAX_ROWS, STOCK, Plan, plain_linears
from mtp_viz.machine import machine_info
from mtp_viz.measured import RETRY_AFTER_S, load_average, still_good

MEASURED_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64)  # row counts timed; others use the next
ROUNDS = 5  # timed rounds per bucket, after one warm-up round
MARGIN = 0.05  # the fast way must be at least this much faster (median) ...
WIN_SHARE = 0.8  # ... and faster in at least this share of the rounds
MAX_SPREAD = 0.15  # a bucket is noisy when either way's rounds spread more (interquartile range / median) ...
RETRIES = 2  # ... and is then measured again, all rounds anew, at most this many times,
BUSY_SHARE = 0.5  # unless more than this share of the buckets is noisy: the machine is busy, retrying won't help
TUNE_BYTES = 48 * 2**20  # time the head and layer weights of this size (beyond an L3), or all of them
PLAN_VERSION = 2  # version 1 did not record how it was measured: measured again
# a record lacking any of these is measured again rather than trusted
RECORDED = ("measured_at", "by", "machine", "load_average", "rounds", "max_spread", "settled", "noisy_rows", "buckets")
BY_LOAD, BY_COMMAND, BY_APP = "first load", "python -m mtp_viz tune", "the app's Theory tab"


Timings = dict[tuple[str, int], list[float]]  # (way, rows) → seconds per round; way is STOCK or FAST
MeasureFn = Callable[[nn.Module, Sequence[int]], Timings]  # (model, buckets) → their timings


class Stopped(Exception):
    """A measurement stopped on request before it finished (nothing is cached)."""


def spread(seconds: Sequence[float]) -> float:
    """How much one bucket's rounds disagree: interquartile range / median (0: steady). One outlier
    among five rounds moves it little, two do; fewer than three rounds cannot tell (infinite)."""
    if len(seconds) < 3:
        return math.inf
    q1, median, q3 = statistics.quantiles(seconds, n=4, method="inclusive")
    return (q3 - q1) / median if median > 0 else math.inf


def clear_cut(fast: Sequence[float], stock: Sequence[float]) -> bool:
    """Every round of one way beat every round of the other by MARGIN: no noise in these rounds
    reverses that verdict (on a quiet 2-core EPYC the output head's padded product at 2 rows ran
    3.5-6.8 ms a round, spread 0.48, against stock's 24.7-26.2 ms)."""
    if not fast or not stock:
        return False
    return max(fast) < (1 - MARGIN) * min(stock) or max(stock) < (1 - MARGIN) * min(fast)


def noisy(timings: Timings, rows: int) -> bool:
    """Either way's rounds at this row count spread beyond MAX_SPREAD, and their rounds overlap
    (a clear-cut bucket is not noisy: its winner won every round by more than the margin)."""
    spread_out = any(spread(timings[way, rows]) > MAX_SPREAD for way in (STOCK, FAST) if (way, rows) in timings)
    return spread_out and not clear_cut(timings.get((FAST, rows), ()), timings.get((STOCK, rows), ()))


def choose(timings: Timings) -> tuple[int, ...]:
    """The padded row count for each r = 0..MAX_ROWS from measured timings (0: stock).

    For r rows, stock costs what it cost at the smallest measured count ≥ r, and the fast way can
    pad to any measured count ≥ r. The fast way is taken only where it beats stock by MARGIN in the
    median and in at least WIN_SHARE of the rounds (rounds are paired: measured back to back), and
    where its rounds spread, in every round. A noisy bucket decides nothing: its rows stay on
    stock and nothing pads to it."""
    timed_rows = sorted({rows for _, rows in timings})
    steady = {m for m in timed_rows if not noisy(timings, m)}
    padded = [0] * (MAX_ROWS + 1)
    for r in range(1, MAX_ROWS + 1):
        at = next((m for m in timed_rows if m >= r), None)
        if at not in steady or (STOCK, at) not in timings:
            continue
        stock = timings[STOCK, at]
        best, best_median = 0, statistics.median(stock)
        for p in (m for m in timed_rows if m >= r and m in steady and (FAST, m) in timings):
            fast = timings[FAST, p]
            wins = sum(f < s for f, s in zip(fast, stock, strict=False)) / min(len(fast), len(stock))
            median = statistics.median(fast)
            sure = spread(fast) <= MAX_SPREAD or max(fast) < (1 - MARGIN) * min(stock)
            if sure and median < (1 - MARGIN) * statistics.median(stock) and wins >= WIN_SHARE and median < best_median:
                best, best_median = p, median
        padded[r] = best
    return tuple(padded)


def tuning_weights(model: nn.Module) -> list[torch.Tensor]:
    """The output head, and the model's other float32 linear weights in order until TUNE_BYTES
    (a weight format's linears have their own kernels: in q4 the head alone is timed)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linears = plain_linears(model)
    weights = [head.weight] if head in linears else []
    total = 0
    for module in linears:
        if module is not head and total < TUNE_BYTES:
            weights.append(module.weight)
            total += module.weight.numel() * module.weight.element_size()
    return weights


def measure(
    weights: Sequence[torch.Tensor],
    rows: Sequence[int] = MEASURED_ROWS,
    rounds: int = ROUNDS,
    clock: Callable[[], float] = time.perf_counter,
    stopped: Callable[[], bool] | None = None,
) -> Timings:
    """Seconds for one pass over `weights` (each times a rows × in input), both ways. Each round
    times every bucket both ways back to back, which way goes first alternating round by round, so
    the machine's drift hits both alike; round 0 warms up and is dropped. Stopped is raised when
    `stopped()` turns true (checked before each round)."""
    inputs = {(w.shape[1], r): torch.randn(r, w.shape[1]) for w in weights for r in rows}
    ways: dict[str, Callable] = {STOCK: lambda x, w: F.linear(x, w), FAST: lambda x, w: torch.mm(w, x.t())}
    timings: Timings = {(way, r): [] for way in ways for r in rows}
    with torch.inference_mode():
        for round_ in range(rounds + 1):
            if stopped is not None and stopped():
                raise Stopped("linear kernel measurement stopped")
            order = (STOCK, FAST) if round_ % 2 else (FAST, STOCK)
            for r in rows:
                for way in order:
                    start = clock()
                    for w in weights:
                        ways[way](inputs[w.shape[1], r], w)
                    elapsed = clock() - start
                    if round_:
                        timings[way, r].append(elapsed)
    return timings


def settle(
    measure_rows: Callable[[Sequence[int]], Timings], rows: Sequence[int] = MEASURED_ROWS, retries: int = RETRIES
) -> tuple[Timings, dict[int, int]]:
    """Every bucket measured, and a noisy one measured again with fresh rounds, at most `retries`
    times: the timings (each bucket's last try) and how many tries each bucket took. When most
    buckets are noisy the machine is busy: nothing is measured again (it would take minutes)."""
    timings: Timings = {}
    tries: dict[int, int] = {}
    todo = list(rows)
    for attempt in range(1, retries + 2):
        timings.update(measure_rows(todo))
        tries.update(dict.fromkeys(todo, attempt))
        todo = [r for r in todo if noisy(timings, r)]
        if not todo or len(todo) > BUSY_SHARE * len(rows):
            break
    return timings, tries


@dataclass(frozen=True)
class Measurement:
    """A plan as measured: the timings behind it (each bucket's last try), the tries each bucket
    took, and how it was measured (when, by what, the machine, its load, the rounds)."""

    plan: Plan
    timings: Timings
    tries: dict[int, int]
    how: dict

    @property
    def noisy_rows(self) -> list[int]:
        return [r for r in sorted(self.tries) if noisy(self.timings, r)]

    def buckets(self) -> dict[int, dict]:
        """Per measured row count: each way's median (ms) and spread, the tries, and the choice."""
        out = {}
        for r in sorted(self.tries):
            entry: dict = {}
            for way in (STOCK, FAST):
                entry[f"{way}_ms"] = round(statistics.median(self.timings[way, r]) * 1e3, 4)
                s = spread(self.timings[way, r])
                entry[f"{way}_spread"] = round(s, 3) if math.isfinite(s) else None
            p = self.plan.padded[r] if r <= MAX_ROWS else 0
            choice = "stock" if not p else FAST if p == r else f"{FAST}, padded to {p}"
            entry.update(tries=self.tries[r], choice=f"{choice} (noisy)" if noisy(self.timings, r) else choice)
            out[r] = entry
        return out

    def record(self) -> dict:
        """The plan as cached: what `cached_plan` reads back, and what the CLI and the Theory tab show."""
        return {
            "version": PLAN_VERSION,
            "padded": list(self.plan.padded),
            "describe": self.plan.describe(),
            "settled": not self.noisy_rows,
            "noisy_rows": self.noisy_rows,
            **self.how,
            "buckets": {str(r): b for r, b in self.buckets().items()},
            "timings_ms": {f"{way}:{r}": [round(t * 1e3, 4) for t in ts] for (way, r), ts in self.timings.items()},
        }


def describe_record(record: dict) -> str:
    """One line on a cached plan: the path it chose, and when, by what, under what load, how steady."""
    spreads = [b[f"{way}_spread"] for b in record["buckets"].values() for way in (STOCK, FAST)]
    worst = f"spread ≤ {max(spreads, default=0.0):.2f}" if None not in spreads else "spread unknown"
    load, cores = record["load_average"], record["machine"].get("cores", "?")
    busy = f"load {load[0]:.1f} on {cores} cores" if load else "load unknown"
    line = f"{record['describe']} (measured {record['measured_at']} by {record['by']}, {record['rounds']} rounds, "
    line += f"{worst}, {busy})"
    if not record["settled"]:
        rows = ", ".join(map(str, record["noisy_rows"]))
        line += f"; rows {rows} too noisy (spread > {record['max_spread']}): stock there until measured again "
        line += f"(by a load {RETRY_AFTER_S / 3600:g} h later, or now by `{BY_COMMAND}`)"
    return line


def valid_record(record: dict) -> bool:
    """Whether a kernel-plan record's linear half is to be trusted: this version, and how it was
    measured (a record without that is measured again rather than trusted)."""
    return measured.valid(record, PLAN_VERSION, RECORDED, lambda r: len(r.get("padded", ())) == MAX_ROWS + 1)


def cached_plan(record: dict, now: float) -> Plan | None:
    """The linear plan a record holds, while it serves (mtp_viz.measured.still_good); else None."""
    if valid_record(record) and still_good(record, now):
        return Plan(tuple(record["padded"]), "cached")
    return None


def measure_plan(
    model: nn.Module,
    by: str,
    rounds: int = ROUNDS,
    measure_fn: MeasureFn | None = None,
    stopped: Callable[[], bool] | None = None,
) -> Measurement:
    """The linear plan for `model` measured now (nothing written: mtp_viz.kernel_plan records it).
    `measure_fn(model, rows)` gives those buckets' timings (tests script it)."""
    if measure_fn is None:
        weights = tuning_weights(model)
        measure_fn = lambda _, rows: measure(weights, rows, rounds, stopped=stopped)  # noqa: E731
    load, started = load_average(), time.time()
    timings, tries = settle(lambda rows: measure_fn(model, rows))
    how = {
        "measured_at": measured.stamp(started),
        "by": by,
        "model": getattr(getattr(model, "config", None), "name_or_path", None) or type(model).__name__,
        "machine": machine_info("cpu"),
        "load_average": load,
        "rounds": rounds,
        "max_spread": MAX_SPREAD,
        "retries": RETRIES,
        "seconds": round(time.time() - started, 2),
    }
    return Measurement(Plan(choose(timings), "measured"), timings, tries, how)
