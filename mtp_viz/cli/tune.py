"""`tune`: measure a model's kernel plan (mtp_viz.kernel_plan) on this machine again, now: the
linear plan (mtp_viz.linear_plan), each bucket's timings, spreads and choice, then the plan cached
for later loads; and each weight format's row plan (mtp_viz.row_plan): whether its products are
row-invariant here, made so how, at what cost."""

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager

from mtp_viz import kernels
from mtp_viz.errors import UserError
from mtp_viz.kernel_plan import plan_path, remeasure, row_plans
from mtp_viz.linear_plan import BY_COMMAND, MAX_SPREAD, ROUNDS, describe_record
from mtp_viz.loading import load_model, model_name, retuned
from mtp_viz.row_plan import PROBED_ROWS, apply
from mtp_viz.weights import FORMATS, FP32

MIN_ROUNDS, MAX_ROUNDS = 3, 50  # a spread needs three rounds


def add(sub) -> None:
    p = sub.add_parser("tune", help="measure the linear kernels' plan on this CPU again (cached for later runs)")
    p.add_argument("--model", help="registry id or local model directory (default: the CPU default)")
    p.add_argument("--rounds", type=int, default=ROUNDS, help=f"timed rounds per row count (default {ROUNDS})")
    p.add_argument("--dry-run", action="store_true", help="measure and print, but leave the cached plan as it is")
    p.add_argument(
        "--weights",
        nargs="+",
        choices=FORMATS,
        default=list(FORMATS),
        help="weight formats whose row plans to measure again (default: all)",
    )
    p.set_defaults(func=cmd_tune)


def cmd_tune(args: argparse.Namespace) -> None:
    if not MIN_ROUNDS <= args.rounds <= MAX_ROUNDS:
        raise UserError(f"--rounds must be {MIN_ROUNDS}..{MAX_ROUNDS}")
    name = model_name(args.model, "cpu")
    with _plan_not_measured_on_load():
        loaded = load_model(name, "cpu", "float32")
    result = remeasure(loaded.model, BY_COMMAND, write=not args.dry_run, rounds=args.rounds)
    record = result.record()
    print(f"{name}: linear products timed both ways, {args.rounds} rounds each, interleaved (ms: median, spread)")
    print("\n".join(table(record)))
    print(f"spread: interquartile range / median; above {MAX_SPREAD}: noisy, measured again, else stock")
    print(f"linear path: {describe_record(record)}")
    if args.dry_run:
        print("dry run: the cached plan is left as it was")
        return
    print(f"cached in {plan_path(loaded.model)}")
    loaded = retuned(loaded, BY_COMMAND)  # the loaded model runs what later loads will
    print(f"row plans: every row of a call of {', '.join(map(str, PROBED_ROWS))} rows against the one-token product")
    for fmt in args.weights:
        model = loaded.model if fmt == FP32 else load_model(name, "cpu", "float32", weights=fmt).model
        records = row_plans(model, BY_COMMAND, again=True)
        apply(model, records)
        for f, entry in records.items():
            print("\n".join(row_lines(f if f == fmt else f"{f} (the {fmt} model's head)", entry)))


def table(record: dict) -> list[str]:
    """One line per measured row count: each way's median (ms) and spread, the tries, the choice."""
    lines = [f"{'rows':>4}  {'stock':>9} {'spread':>6}  {'fast':>9} {'spread':>6}  {'tries':>5}  choice"]
    for rows, b in record["buckets"].items():
        stock = f"{b['stock_ms']:>9.3f} {_spread(b['stock_spread']):>6}"
        fast = f"{b['fast_ms']:>9.3f} {_spread(b['fast_spread']):>6}"
        lines.append(f"{rows:>4}  {stock}  {fast}  {b['tries']:>5}  {b['choice']}")
    return lines


def row_lines(label: str, entry: dict) -> list[str]:
    """A format's row plan: what each candidate gave, the costs (ms, 1 and 4 rows), the choice."""
    lines = [f"  {label}: {entry['describe']}"]
    for plan, verdict in entry["tried"].items():
        cost = entry["cost_ms"].get(plan)
        timing = f"  1 row {cost['1']:.2f} ms, 4 rows {cost['4']:.2f} ms" if cost else ""
        lines.append(f"    {plan:<30} {verdict}{timing}")
    return lines


def _spread(value: float | None) -> str:
    return "?" if value is None else f"{value:.3f}"


@contextmanager
def _plan_not_measured_on_load() -> Iterator[None]:
    """Load on the stock path: this command measures the plan itself, once."""
    before = os.environ.get(kernels.ENV)
    os.environ[kernels.ENV] = kernels.STOCK
    try:
        yield
    finally:
        if before is None:
            del os.environ[kernels.ENV]
        else:
            os.environ[kernels.ENV] = before
