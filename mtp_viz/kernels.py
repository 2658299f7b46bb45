"""Linear layers for the few-row products of decoding on a CPU, the path chosen by measurement.

Decoding multiplies each weight matrix by 1 to a few dozen rows (one token, a draft, a tree).
Two ways to compute that product differ by up to 2x, and which is faster depends on the CPU, its
BLAS build and the row count:
- `stock`: `F.linear(x, W)`, i.e. the BLAS's matrix-vector / small-matrix path;
- `fast`: `W @ xᵀ` with the weight on the left, the rows padded with zeros to a chosen count
  (measured on an AMD EPYC with oneMKL: padding 1 row to 4 streams the weights at ~1.6x the speed
  of F.linear; on an Intel Xeon with AMX the same trick halved the speed).

So nothing is hard-wired: a `Plan` says, for each row count, stock or the padded product, and is
measured per machine and model shapes (mtp_viz.linear_plan: measured on first load, cached, and
measured again by `python -m mtp_viz tune`).

MTP_VIZ_LINEAR=auto (default) | stock | fast (the fixed buckets measured on the AMD machine, for
comparisons). Only float32 CPU tensors are affected: GPUs and other dtypes keep F.linear.
`benchmarks/cpu_linear.py` measures both ways side by side.

A `RowPlan` is the other half of a product's path: not how fast, but how exact. A verify's rows
must each compute what the one-token forward computes, and a kernel may sum a row in another
order at another row count (oneDNN's bf16 one-row product on an AMD EPYC; its AMX kernels on an
Intel Xeon; MKL's sgemm at 1, 2-3 and 4+ rows). A row plan pads short calls with zero rows and
splits long ones into chunks, so that every call a row is in runs at row counts measured to
agree (mtp_viz.row_plan measures it per machine and format).
"""

import logging
import os
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

log = logging.getLogger(__name__)

ENV = "MTP_VIZ_LINEAR"
AUTO, STOCK, FAST = "auto", "stock", "fast"
MODES = (AUTO, STOCK, FAST)
MAX_ROWS = 64  # beyond this (prefill, training batches) F.linear always
FIXED_BUCKETS = (2, 4, 5, 16)  # the `fast` mode: pad up to the next of these, stock beyond (AMD-measured)


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


@dataclass(frozen=True)
class RowPlan:
    """How a product's rows are grouped into kernel calls: a call of fewer than `pad_to` rows is
    padded with zero rows to `pad_to`; more than `chunk` rows (None: no bound) run in chunks of
    `chunk`, each padded alike; beyond MAX_ROWS rows (prefill, training) a call runs as it comes.
    `exact`: measured to give every row the one-token product's
    result at every probed row count (False: none could here, `why` says where it parts)."""

    pad_to: int = 1
    chunk: int | None = None
    exact: bool = True
    why: str = ""

    def __call__(self, product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """product(x) for x (M, in), computed as this plan groups the rows: (M, out)."""
        rows = x.shape[0]
        if rows == 0 or rows > MAX_ROWS or (rows >= self.pad_to and (self.chunk is None or rows <= self.chunk)):
            return product(x)
        step = self.chunk or rows
        parts = []
        for start in range(0, rows, step):
            part = x[start : start + step]  # (m, in)
            n = part.shape[0]
            if n < self.pad_to:
                part = torch.cat([part, part.new_zeros(self.pad_to - n, part.shape[1])])
            parts.append(product(part)[:n])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def describe(self) -> str:
        """ "as is", "1 row padded to 2", "padded to 4, in chunks of 4", with "not exact" where so."""
        if self.pad_to == 1 and self.chunk is None:
            text = "as is"
        elif self.chunk is None:
            text = f"1-{self.pad_to - 1} rows padded to {self.pad_to}" if self.pad_to > 2 else "1 row padded to 2"
        else:
            text = f"padded to {self.pad_to}, in chunks of {self.chunk}"
            text = text if self.pad_to > 1 else f"{self.chunk} rows a call"
        return text if self.exact else f"{text}; not lossless on this machine ({self.why})"


RAW_ROWS = RowPlan()  # every call as it comes


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


def planned_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: Plan, rows: RowPlan
) -> torch.Tensor:
    """`fast_linear` under `plan`, its rows grouped into calls by `rows` (float32 on a CPU only)."""
    if rows == RAW_ROWS or weight.device.type != "cpu" or x.dtype != torch.float32:
        return fast_linear(x, weight, bias, plan)
    flat = x.reshape(-1, x.shape[-1])  # (m, in)
    y = rows(lambda part: fast_linear(part, weight, bias, plan), flat)
    return y.view(*x.shape[:-1], weight.shape[0])


_PLAIN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # FastLinear → its plain nn.Linear (`plain`)


class Planned(nn.Module):
    """A module whose products run `fast_linear` under a linear `plan`: FastLinear, and modules
    that call fast_linear themselves (a drafter's reduced head). `use_fast_linears` sets it."""

    plan: Plan = STOCK_PLAN


class FastLinear(nn.Linear, Planned):
    """A linear layer computing by `fast_linear` under its `plan`, its rows grouped by its
    `row_plan`. Made `of` an nn.Linear: the same parameters (not copies), so the same state dict."""

    row_plan: RowPlan = RAW_ROWS

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, plan: Plan = STOCK_PLAN):
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.register_parameter("weight", weight)
        self.register_parameter("bias", bias)
        self.plan = plan

    @classmethod
    def of(cls, linear: nn.Linear, plan: Plan = STOCK_PLAN) -> "FastLinear":
        fast = cls(linear.weight, linear.bias, plan)
        _PLAIN[fast] = linear
        return fast

    def plain(self) -> nn.Linear:
        """The nn.Linear over the same parameters: the one this was made `of`, else one made once
        (on the meta device, then given these parameters). The same object each time, so that a
        compiled peer (mtp_viz.peers) meets the modules it was compiled for."""
        linear = _PLAIN.get(self)
        if linear is None or linear.weight is not self.weight or linear.bias is not self.bias:
            linear = nn.Linear(self.in_features, self.out_features, self.bias is not None, device="meta")
            linear.weight, linear.bias = self.weight, self.bias
            _PLAIN[self] = linear
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return planned_linear(x, self.weight, self.bias, self.plan, self.row_plan)


# a module's hook registries (forward, backward, state dict; with their kwargs and always-called marks)
HOOKS = tuple(name for name in vars(nn.Linear(1, 1, device="meta")) if "hook" in name)


def replace_module(parent: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Put `new` in place of `parent`'s child `name`, as gpt-fast's quantize.py swaps linears;
    `new` takes over the old one's hooks (the same dicts: a mask-only adapter's gate, mtp_viz.
    drafters.mask) and its train/eval mode. Returns `new`."""
    old = getattr(parent, name)
    for hooks in HOOKS:
        setattr(new, hooks, getattr(old, hooks))
    new.train(old.training)
    setattr(parent, name, new)
    return new


def plain_linears(model: nn.Module) -> list[nn.Linear]:
    """The model's own float32 linears (FastLinear included), not those a weight format holds
    (mtp_viz.weights' FormatLinear subclasses nn.Linear but computes by its own kernel)."""
    return [m for m in model.modules() if type(m) in (nn.Linear, FastLinear)]


def use_fast_linears(model: nn.Module, plan: Plan) -> nn.Module:
    """Every plain nn.Linear in `model` replaced in its parent by a FastLinear `of` it under
    `plan`, and every Planned module (FastLinears made earlier too) put on `plan`. Returns the
    model (a FastLinear when `model` itself is a plain nn.Linear)."""
    if type(model) is nn.Linear:
        return FastLinear.of(model, plan)
    made: dict[nn.Module, FastLinear] = {}  # a linear under two parents becomes one FastLinear
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                made[child] = made.get(child) or FastLinear.of(child, plan)
                replace_module(parent, name, made[child])
    for module in model.modules():
        if isinstance(module, Planned):
            module.plan = plan
    return model


@contextmanager
def stock_linears(model: nn.Module) -> Iterator[nn.Module]:
    """The model as transformers loads it, for the duration: every FastLinear replaced by a plain
    nn.Linear over the same parameters, so peers (transformers' own generate) and training run
    the plain model; the FastLinears are put back after."""
    swapped = [(p, name, m) for p in model.modules() for name, m in p.named_children() if type(m) is FastLinear]
    for parent, name, fast in swapped:
        replace_module(parent, name, fast.plain())
    try:
        yield model
    finally:
        for parent, name, fast in swapped:
            setattr(parent, name, fast)


def plan_of(model: nn.Module) -> Plan:
    """The plan a model's linears run under (STOCK_PLAN when none was set)."""
    return next((m.plan for m in model.modules() if isinstance(m, FastLinear)), STOCK_PLAN)
