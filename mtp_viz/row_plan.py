"""Row plans measured on this machine: each format's products grouped into kernel calls so that a
verify's rows compute what the one-token forward computes, which is what keeps a lossless
strategy identical to autoregressive decoding on the same weights.

After the prompt a strategy's target attends one row at a time (mtp_viz.kv_slots.RowKeys), so
what remains is the linear products: a kernel may sum a row in another order at another row count
(oneDNN's bf16 kernels at one row on an AMD EPYC, its AMX kernels on an Intel Xeon, MKL's sgemm at
1, 2-3 and 4+ rows). That is a property of the machine, so it is measured, not assumed: for each
product the forward calls (fused q|k|v and gate|up, o, down, the head; one per format and shape)
and every row count a strategy verifies (PROBED_ROWS), every row of an M-row call must equal, bit
for bit, that row computed as the one-token forward computes it. The candidates (CANDIDATES,
cheapest first: pad short calls with zero rows, split long ones into chunks) are probed until
TIMED of them are exact; of those the first is chosen unless another is faster over a one-token
and a 4-row pass of the model's products, clearly (by the kernel plan's rules: MARGIN in the
median, WIN_SHARE of the rounds, steady ones), and the costs are recorded beside those of the
calls as they come. Where none is exact the
format is not lossless here: its plan says so and where a row parts, the trace's machine line
(`linear`) and `tune` print it, and `auto` (mtp_viz.weights_auto) does not choose the format.

Measured on first load per machine and model shapes, kept in the kernel plan's record
(mtp_viz.kernel_plan, section "rows"), measured again by `python -m mtp_viz tune`. Calls beyond
MAX_ROWS rows (prefill, training) run as they come, as the kernel plan's do.
"""

import logging
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict

import torch
from torch import nn

from mtp_viz import measured
from mtp_viz.kernels import MAX_ROWS, RAW_ROWS, FastLinear, RowPlan, fast_linear
from mtp_viz.lean import lean_model
from mtp_viz.linear_plan import BY_LOAD, MARGIN, MAX_SPREAD, WIN_SHARE, spread
from mtp_viz.machine import machine_info
from mtp_viz.projections import Concat, FusedLinear, StackedLoRA, base_linear, plan_of_linear
from mtp_viz.weights import FP32, FormatLinear

log = logging.getLogger(__name__)

# 1-17: autoregressive decoding, speculative and mask_spec chains (k + 1), mtp_heads' trees (the
# large one: 10 rows); 20-64 by 4: lookahead's forward (cur, (N−1)·W − 1 window rows, up to G
# candidates of N−1 tokens: 28-56 rows at Spec-Bench's N=5, W=7, G=7) and bigger trees
PROBED_ROWS = (*range(1, 18), *range(20, MAX_ROWS + 1, 4))
CANDIDATES = tuple(
    RowPlan(pad, chunk)
    for pad, chunk in ((1, None), (2, None), (2, 2), (4, None), (4, 4), (8, None), (8, 8), (16, None))
    + ((16, 16), (32, None), (64, None), (1, 1))
)
TIMED = 2  # exact candidates timed against each other (the first found, in CANDIDATES' order)
COST_ROWS = (1, 4)  # a plan's cost: a one-token pass and a 4-row verify pass over the model's products
ROUNDS = 5  # timed rounds, interleaved, after one warm-up
SECTION, VERSION = "rows", 1

Product = Callable[[torch.Tensor], torch.Tensor]  # one kernel call: x (M, in) → (M, out)
# format → per product: (out, in), the product, its input dtype, its kernel plan (fp32: mtp_viz.kernels)
Products = dict[str, list[tuple[tuple[int, int], Product, torch.dtype, str]]]


def _leaves(p) -> Iterator[nn.Module | FusedLinear]:
    """The linear products behind one of a block's projections (LoRA terms aside)."""
    if isinstance(p, StackedLoRA):
        yield from _leaves(p.base)
    elif isinstance(p, Concat):
        for m in p.modules:
            yield base_linear(m)
    else:
        yield base_linear(p)


def _product(m) -> tuple[str, tuple[tuple[int, int], Product, torch.dtype, str]] | None:
    if isinstance(m, FormatLinear):
        return m.fmt, ((m.out_features, m.in_features), m.product, m.compute, "")
    if isinstance(m, FusedLinear) or (isinstance(m, nn.Linear) and m.weight.dtype == torch.float32):
        plan = plan_of_linear(m.source if isinstance(m, FusedLinear) else m)[0]
        weight = m.weight
        return FP32, (tuple(weight.shape), lambda x: fast_linear(x, weight, None, plan), torch.float32, plan.describe())
    return None


def products(model: nn.Module) -> Products:
    """Every linear product a one-token forward of `model` calls (the lean forward's, fused where it
    fuses; the modules' own elsewhere), by format, each raw: one kernel call, no row plan."""
    lean = lean_model(model)
    if lean is not None:
        projections = [p for b in lean.blocks for p in (b.proj.qkv, b.proj.o, b.proj.gate_up, b.proj.down)]
        parts = [leaf for p in projections for leaf in _leaves(p)]
        parts.append(base_linear(lean.head))
    else:
        parts = [m for name, m in model.named_modules() if isinstance(m, nn.Linear) and "lora_" not in name]
    found: Products = {}
    for fmt, made in filter(None, map(_product, parts)):
        found.setdefault(fmt, []).append(made)
    return found


def first_failure(product: Product, inputs: int, dtype: torch.dtype, plan: RowPlan, rows=PROBED_ROWS) -> int | None:
    """The first row count in `rows` at which some row of a call planned by `plan` differs from
    that row alone planned by `plan` (the one-token forward's product), or None: exact."""
    x = torch.randn(max(rows), inputs, generator=torch.Generator().manual_seed(len(rows))).to(dtype)  # (R, in)
    alone = torch.cat([plan(product, x[i : i + 1]) for i in range(len(x))])  # (R, out)
    return next((m for m in rows if not torch.equal(plan(product, x[:m]), alone[:m])), None)


def probe(fmt: str, found: list, plan: RowPlan, rows=PROBED_ROWS) -> str | None:
    """Why `plan` is not exact for these products ("bf16 576x1536: a row of a 10-row product differs
    from the one-token product": the first shape and row count that part), or None."""
    seen: set[tuple[int, int]] = set()
    for shape, product, dtype, _ in found:
        if shape in seen:
            continue
        seen.add(shape)
        at = first_failure(product, shape[1], dtype, plan, rows)
        if at is not None:
            where = f"{shape[0]}x{shape[1]}"
            return f"{fmt} {where}: a row of a {at}-row product differs from the one-token product"
    return None


def timed(found: list, plans: list[RowPlan]) -> dict[RowPlan, dict[int, list[float]]]:
    """Seconds of one pass over every product, per plan and row count in COST_ROWS, round by
    round (interleaved: which plan goes first rotates; round 0 warms up and is dropped)."""
    inputs = {(s[1], r, dtype): torch.randn(r, s[1]).to(dtype) for s, _, dtype, _ in found for r in COST_ROWS}
    times: dict[RowPlan, dict[int, list[float]]] = {p: {r: [] for r in COST_ROWS} for p in plans}
    with torch.inference_mode():
        for round_ in range(ROUNDS + 1):
            for p in plans[round_ % len(plans) :] + plans[: round_ % len(plans)]:
                for r in COST_ROWS:
                    start = time.perf_counter()
                    for shape, product, dtype, _ in found:
                        p(product, inputs[shape[1], r, dtype])
                    if round_:
                        times[p][r].append(time.perf_counter() - start)
    return times


def measure(fmt: str, found: list, rows=PROBED_ROWS, by: str = BY_LOAD) -> dict:
    """The row plan for one format's products on this machine, and how it was found (the record)."""
    started, load = time.time(), measured.load_average()
    failures: dict[RowPlan, str | None] = {}
    with torch.inference_mode():
        for plan in CANDIDATES:
            failures[plan] = probe(fmt, found, plan, rows)
            if sum(f is None for f in failures.values()) >= TIMED:
                break
    exact = [p for p, f in failures.items() if f is None]
    costs = timed(found, list(dict.fromkeys([RAW_ROWS, *exact])))
    if exact:
        chosen = cheapest(exact, {p: [sum(t) for t in zip(*c.values(), strict=True)] for p, c in costs.items()})
    else:
        chosen = RowPlan(exact=False, why=failures[RAW_ROWS] or "")
    return {
        "version": VERSION,
        "plan": asdict(chosen),
        "describe": chosen.describe(),
        "shapes": shapes(found),
        "probed_rows": list(rows),
        "tried": {p.describe(): f or "exact" for p, f in failures.items()},
        "cost_ms": {
            p.describe(): {str(r): round(statistics.median(t) * 1e3, 3) for r, t in c.items()} for p, c in costs.items()
        },
        "measured_at": measured.stamp(started),
        "by": by,
        "machine": machine_info("cpu"),
        "load_average": load,
        "seconds": round(time.time() - started, 2),
    }


def cheapest(exact: list[RowPlan], rounds: dict[RowPlan, list[float]]) -> RowPlan:
    """The first exact plan (CANDIDATES' order: least padding first), unless a later one is faster
    by MARGIN in the median and in WIN_SHARE of the paired rounds, both steady (spread at most
    MAX_SPREAD): a busy machine's timings do not trade a plan for another (seen here: a burst made
    int8's calls as they come 80 ms against 21 ms padded, medians of interleaved rounds)."""
    best = exact[0]
    for p in exact[1:]:
        base, other = rounds[best], rounds[p]
        wins = sum(o < b for o, b in zip(other, base, strict=True)) / len(base)
        steady = spread(base) <= MAX_SPREAD and spread(other) <= MAX_SPREAD
        if steady and wins >= WIN_SHARE and statistics.median(other) < (1 - MARGIN) * statistics.median(base):
            best = p
    return best


def shapes(found: list) -> list[list]:
    """What a record is good for: the products' distinct shapes, input dtypes and (fp32) kernel plans."""
    return [list(s) for s in sorted({(*shape, str(dtype), kernel) for shape, _, dtype, kernel in found})]


def plan_of_record(entry: dict) -> RowPlan:
    return RowPlan(**entry["plan"])


def plans_for(model: nn.Module, cached: dict | None, by: str = BY_LOAD) -> tuple[dict[str, dict], dict[str, dict]]:
    """Per format `model` computes in: its row-plan entry, from `cached` (a record's section, keyed
    by `entry_key`) where it holds for these products, else probed now; and the entries probed now,
    by key (the caller records them)."""
    out, probed = {}, {}
    for fmt, found in products(model).items():
        key = entry_key(fmt, found)
        entry = (cached or {}).get(key)
        if not _good(entry, found):
            log.warning("checking that %s products are row-invariant on this machine (once)", fmt)
            entry = probed[key] = measure(fmt, found, by=by)
            if not entry["plan"]["exact"]:
                log.warning("%s is not lossless on this machine: %s", fmt, entry["plan"]["why"])
        out[fmt] = entry
    return out, probed


def entry_key(fmt: str, found: list) -> str:
    """Where a format's row plan sits in the record: "q4", or "fp32 (fast 1-2→2, …)": float32's
    under each kernel plan it was probed on (`tune` loads on the stock path, then measures)."""
    kernels = sorted({kernel for *_, kernel in found if kernel})
    return f"{fmt} ({'; '.join(kernels)})" if kernels else fmt


def _good(entry: dict | None, found: list) -> bool:
    """Whether a cached entry holds for these products: its version, shapes and probed rows."""
    return measured.valid(
        entry, VERSION, check=lambda e: e.get("shapes") == shapes(found) and e.get("probed_rows") == list(PROBED_ROWS)
    )


def use_row_plans(model: nn.Module, plans: dict[str, RowPlan]) -> nn.Module:
    """Give each of the model's products its format's row plan, in place (fused ones read their
    first part's); returns the model."""
    for m in model.modules():
        if isinstance(m, FormatLinear) and m.fmt in plans:
            m.row_plan = plans[m.fmt]
        elif isinstance(m, FastLinear) and FP32 in plans:
            m.row_plan = plans[FP32]
    return model


def apply(model: nn.Module, entries: dict[str, dict]) -> nn.Module:
    """Give `model`'s products the row plans of these entries (per format), in place."""
    return use_row_plans(model, {fmt: plan_of_record(e) for fmt, e in entries.items()})


def applied(model: nn.Module) -> dict[str, RowPlan]:
    """The row plan each format of `model` runs under now (fused products read their parts')."""
    out: dict[str, RowPlan] = {}
    for m in model.modules():
        if isinstance(m, FormatLinear):
            out.setdefault(m.fmt, m.rows())
        elif isinstance(m, FastLinear):
            out.setdefault(FP32, m.row_plan)
    return out


def describe(model: nn.Module) -> str:
    """ "rows: q4 as is; fp32 padded to 4, in chunks of 4" or "…; not lossless on this machine (…)": for the trace."""
    plans = applied(model)
    return "rows: " + "; ".join(f"{fmt} {p.describe()}" for fmt, p in plans.items()) if plans else ""


def not_lossless(model: nn.Module) -> list[str]:
    """Why `model`'s verify rows may differ from its one-token forwards here (empty: they do not)."""
    return [p.why for p in applied(model).values() if not p.exact]
