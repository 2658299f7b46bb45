"""Linear layers for the few-row products of decoding on a CPU, the path chosen by measurement.

Decoding multiplies each weight matrix by 1 to a few dozen rows (one token, a draft, a tree).
Two ways to compute that product differ by up to 2x, and which is faster depends on the CPU, its
BLAS build and the row count:
- `stock`: `F.linear(x, W)`, i.e. the BLAS's matrix-vector / small-matrix path;
- `fast`: `W @ xᵀ` with the weight on the left, the rows padded with zeros to a chosen count
  (measured on an AMD EPYC with oneMKL: padding 1 row to 4 streams the weights at ~1.6x the speed
  of F.linear; on an Intel Xeon with AMX the same trick halved the speed).

So nothing is hard-wired: on first load on a machine, `tune` times both ways on the model's own
weight shapes, for every row count up to MAX_ROWS, interleaved in rounds so noise hits both alike,
and keeps a `Plan`: for each row count, stock or the padded product. The fast way is chosen only
where it wins clearly (by MARGIN, in most rounds); when the timings are too noisy to tell, stock
wins. Plans are cached on disk, keyed by the machine (CPU model and flags, threads, torch, BLAS:
mtp_viz.machine) and the weight shapes, so later loads pay nothing.

MTP_VIZ_LINEAR=auto (default) | stock | fast (the fixed buckets measured on the AMD machine, for
comparisons). Only float32 CPU tensors are affected: GPUs and other dtypes keep F.linear.
`benchmarks/cpu_linear.py` measures both ways side by side.
"""

import hashlib
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from mtp_viz.machine import machine_info, machine_key
from mtp_viz.paths import cache_root

log = logging.getLogger(__name__)

ENV = "MTP_VIZ_LINEAR"
AUTO, STOCK, FAST = "auto", "stock", "fast"
MODES = (AUTO, STOCK, FAST)
MAX_ROWS = 64  # beyond this (prefill, training batches) F.linear always
MEASURED_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64)  # row counts timed; others use the next
FIXED_BUCKETS = (2, 4, 5, 16)  # the `fast` mode: pad up to the next of these, stock beyond (AMD-measured)
ROUNDS = 4
MARGIN = 0.05  # the fast way must be at least this much faster (median) ...
WIN_SHARE = 0.8  # ... and faster in at least this share of the rounds
TUNE_BYTES = 48 * 2**20  # time the head and layer weights of this size (beyond an L3), or all of them
PLAN_VERSION = 1


@dataclass(frozen=True)
class Plan:
    """padded[r] for r = 0..MAX_ROWS: 0 = F.linear, p ≥ r = W @ xᵀ with the rows padded to p."""

    padded: tuple[int, ...]
    source: str = STOCK  # stock | fast | measured (auto) | cached (auto, from an earlier load)

    def describe(self) -> str:
        """ "fast 1-2→2, 3-4→4, 5; stock 6-64" (row ranges, → the padded count) or "stock"."""
        fast: list[list[int]] = []  # [first, last, padded]
        stock: list[list[int]] = []
        for r in range(1, len(self.padded)):
            p = self.padded[r]
            runs, key = (fast, p) if p else (stock, 0)
            if runs and runs[-1][2] == key and runs[-1][1] == r - 1:
                runs[-1][1] = r
            else:
                runs.append([r, r, key])
        if not fast:
            return "stock"

        def span(a: int, b: int, p: int) -> str:
            text = f"{a}" if a == b else f"{a}-{b}"
            return f"{text}→{p}" if p and (p != b or a != b) else text

        parts = ["fast " + ", ".join(span(*run) for run in fast)]
        if stock:
            parts.append("stock " + ", ".join(span(*run) for run in stock))
        return "; ".join(parts)


STOCK_PLAN = Plan((0,) * (MAX_ROWS + 1), STOCK)
FIXED_PLAN = Plan(
    tuple(0 if r == 0 else next((b for b in FIXED_BUCKETS if b >= r), 0) for r in range(MAX_ROWS + 1)), FAST
)


def mode() -> str:
    value = os.environ.get(ENV, AUTO).strip().lower() or AUTO
    if value not in MODES:
        log.warning("%s=%s is not one of %s; using %s", ENV, value, ", ".join(MODES), AUTO)
        return AUTO
    return value


def fast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, plan: Plan = STOCK_PLAN):
    """x (..., in) @ weightᵀ (+ bias) → (..., out), as `F.linear`, by the way `plan` chose for this row count."""
    rows = x.numel() // max(1, x.shape[-1])
    padded = plan.padded[rows] if rows <= MAX_ROWS else 0
    if not padded or weight.device.type != "cpu" or weight.dtype != torch.float32 or x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])  # (m, in)
    if padded > rows:
        flat = torch.cat([flat, flat.new_zeros(padded - rows, flat.shape[1])])
    y = torch.mm(weight, flat.t())[:, :rows].t().contiguous()  # (m, out)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


class FastLinear(nn.Linear):
    """An `nn.Linear` whose forward is `fast_linear` under its `plan` (same parameters and state dict)."""

    plan: Plan = STOCK_PLAN

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fast_linear(x, self.weight, self.bias, self.plan)


def use_fast_linears(model: nn.Module, plan: Plan) -> nn.Module:
    """Switch every plain `nn.Linear` in `model` to FastLinear under `plan`, in place, and give the
    plan to modules that call fast_linear themselves (a `plan` attribute); returns the model."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = FastLinear
        if isinstance(module, FastLinear) or hasattr(module, "plan"):
            module.plan = plan
    return model


@contextmanager
def stock_linears(model: nn.Module) -> Iterator[nn.Module]:
    """The model as transformers loads it, for the duration: every FastLinear an nn.Linear again
    (same weights), so peers (transformers' own generate) run the plain model."""
    switched = [m for m in model.modules() if type(m) is FastLinear]
    for m in switched:
        m.__class__ = nn.Linear
    try:
        yield model
    finally:
        for m in switched:
            m.__class__ = FastLinear


def plan_of(model: nn.Module) -> Plan:
    """The plan a model's linears run under (STOCK_PLAN when none was set)."""
    return next((m.plan for m in model.modules() if isinstance(m, FastLinear)), STOCK_PLAN)


# --- choosing a plan -------------------------------------------------------------------------

Timings = dict[tuple[str, int], list[float]]  # (way, rows) → seconds per round; way is STOCK or FAST


def choose(timings: Timings) -> tuple[int, ...]:
    """The padded row count for each r = 0..MAX_ROWS from measured timings (0: stock).

    For r rows, stock costs what it cost at the smallest measured count ≥ r, and the fast way can
    pad to any measured count ≥ r. The fast way is taken only where it beats stock by MARGIN in the
    median and in at least WIN_SHARE of the rounds (rounds are paired: measured back to back)."""
    measured = sorted({rows for _, rows in timings})
    padded = [0] * (MAX_ROWS + 1)
    for r in range(1, MAX_ROWS + 1):
        at = next((m for m in measured if m >= r), None)
        if at is None or (STOCK, at) not in timings:
            continue
        stock = timings[STOCK, at]
        best, best_median = 0, statistics.median(stock)
        for p in (m for m in measured if m >= r and (FAST, m) in timings):
            fast = timings[FAST, p]
            wins = sum(f < s for f, s in zip(fast, stock, strict=False)) / min(len(fast), len(stock))
            median = statistics.median(fast)
            if median < (1 - MARGIN) * statistics.median(stock) and wins >= WIN_SHARE and median < best_median:
                best, best_median = p, median
        padded[r] = best
    return tuple(padded)


def tuning_weights(model: nn.Module) -> list[torch.Tensor]:
    """The output head, and the model's other linear weights in order until TUNE_BYTES."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weights = [head.weight] if isinstance(head, nn.Linear) else []
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and module is not head and total < TUNE_BYTES:
            weights.append(module.weight)
            total += module.weight.numel() * module.weight.element_size()
    return weights


def measure(weights: Sequence[torch.Tensor], rows: Sequence[int] = MEASURED_ROWS, rounds: int = ROUNDS) -> Timings:
    """Seconds for one pass over `weights` (each times a rows × in input), both ways, every round
    interleaved so the machine's noise hits both alike."""
    inputs = {(w.shape[1], r): torch.randn(r, w.shape[1]) for w in weights for r in rows}
    ways: dict[str, Callable] = {STOCK: lambda x, w: F.linear(x, w), FAST: lambda x, w: torch.mm(w, x.t())}
    timings: Timings = {(way, r): [] for way in ways for r in rows}
    with torch.inference_mode():
        for round_ in range(rounds + 1):  # round 0 warms up and is dropped
            for r in rows:
                for way, fn in ways.items():
                    start = time.perf_counter()
                    for w in weights:
                        fn(inputs[w.shape[1], r], w)
                    if round_:
                        timings[way, r].append(time.perf_counter() - start)
    return timings


def plan_path(model: nn.Module) -> Path:
    shapes = sorted({tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)})
    name = f"{machine_key()}-{hashlib.sha256(repr(shapes).encode()).hexdigest()[:10]}"
    return cache_root() / "kernels" / f"{name}.json"


def tune(model: nn.Module, measure_fn: Callable[[nn.Module], Timings] | None = None) -> Plan:
    """The plan for `model` on this machine: by MTP_VIZ_LINEAR, else cached, else measured now."""
    chosen = mode()
    if chosen == STOCK:
        return STOCK_PLAN
    if chosen == FAST:
        return FIXED_PLAN
    path = plan_path(model)
    try:
        data = json.loads(path.read_text())
        if data.get("version") == PLAN_VERSION and len(data["padded"]) == MAX_ROWS + 1:
            return Plan(tuple(data["padded"]), "cached")
    except (OSError, ValueError, KeyError):
        pass
    log.warning("timing the linear kernels on this machine once for this model's shapes (a few seconds)")
    timings = (measure_fn or (lambda m: measure(tuning_weights(m))))(model)
    plan = Plan(choose(timings), "measured")
    log.warning("linear path: %s", plan.describe())
    record = {
        "version": PLAN_VERSION,
        "padded": list(plan.padded),
        "describe": plan.describe(),
        "machine": machine_info("cpu"),
        "timings_ms": {f"{way}:{r}": [round(t * 1e3, 3) for t in ts] for (way, r), ts in timings.items()},
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(record, f, indent=1)
        os.replace(f.name, path)
    except OSError as e:
        log.warning("could not cache the linear plan in %s: %s", path, e)
    return plan
