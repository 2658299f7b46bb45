"""A model's kernel plan on this machine, in one pass: how its products compute (mtp_viz.kernels).

Two halves, one record per machine and model shapes (mtp_viz.measured, folder "kernels"):
- the linear path: for each row count, F.linear or the padded weight-on-the-left product for the
  float32 linears left (every one in fp32, the head in the other formats), timed by
  mtp_viz.linear_plan ("padded", and how it was measured);
- the row plans: for each weight format the model computes in, how a call's rows are grouped so
  that every verify row computes what the one-token forward computes, probed by mtp_viz.row_plan
  (section "rows": the float32 products' plan is probed on the linear path, so it comes second).

`tune` is the pass a load makes: the record read once, what is missing or stale measured (the
linear path by MTP_VIZ_LINEAR where that forces one), both halves applied to the model, the record
written once when anything was measured. `remeasure` and `row_plans(again=True)` measure one half
again on purpose (`python -m mtp_viz tune`, the Theory tab); the next load reads what they wrote.
"""

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from mtp_viz import linear_plan, measured, row_plan
from mtp_viz.kernels import FAST, FIXED_PLAN, STOCK, STOCK_PLAN, Plan, mode, plain_linears, use_fast_linears
from mtp_viz.linear_plan import BY_LOAD, ROUNDS, MeasureFn, Measurement, cached_plan, describe_record, valid_record

log = logging.getLogger(__name__)

FOLDER = "kernels"
ROWS = row_plan.SECTION  # the record's section of row plans, per format (and float32 kernel path)


def plan_path(model: nn.Module) -> Path:
    """This machine's kernel-plan record for the model's float32 linear shapes."""
    shapes = sorted({tuple(m.weight.shape) for m in plain_linears(model)})
    return measured.record_path(FOLDER, measured.fingerprint(repr(shapes)))


def read_record(path: Path) -> dict | None:
    """The linear half of the record at `path`, or None when there is none to trust (measure it)."""
    record = measured.read_raw(path)
    return record if valid_record(record) else None


def machine_records() -> list[dict]:
    """This machine's trusted kernel-plan records (every model's shapes), newest first."""
    records = [r for r in map(read_record, measured.machine_paths(FOLDER)) if r is not None]
    return sorted(records, key=lambda r: r["measured_at"], reverse=True)


def tune(model: nn.Module, by: str = BY_LOAD, measure_fn: MeasureFn | None = None) -> Plan | None:
    """Read, measure what is missing, apply and record `model`'s kernel plan: the linear path it
    now runs (None off a CPU or outside float32: F.linear and the kernels as they come there)."""
    weight = next(model.parameters(), None)
    if weight is None or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    path = plan_path(model)
    record = measured.read_raw(path)
    changed = False
    chosen = mode()
    plan = STOCK_PLAN if chosen == STOCK else FIXED_PLAN if chosen == FAST else cached_plan(record, time.time())
    if plan is None:
        log.warning("timing the linear kernels on this machine for this model's shapes (a few seconds)")
        result = linear_plan.measure_plan(model, by, ROUNDS, measure_fn)
        log.warning("linear path: %s", describe_record(result.record()))
        record, plan, changed = {**record, **result.record()}, result.plan, True
    use_fast_linears(model, plan)
    entries, measured_now = row_plan.plans_for(model, record.get(ROWS), by)
    if measured_now:
        record[ROWS] = {**(record.get(ROWS) or {}), **measured_now}
        changed = True
    if changed:
        measured.write(path, record, what="the kernel plan")
    row_plan.apply(model, entries)
    return plan


def remeasure(
    model: nn.Module,
    by: str,
    write: bool = True,
    rounds: int = ROUNDS,
    measure_fn: MeasureFn | None = None,
    stopped: Callable[[], bool] | None = None,
) -> Measurement:
    """The linear path measured again now, whatever MTP_VIZ_LINEAR says, and recorded (its row
    plans kept) unless not `write`. `measure_fn(model, rows)` gives timings (tests script it)."""
    result = linear_plan.measure_plan(model, by, rounds, measure_fn, stopped)
    if write:
        measured.write(plan_path(model), result.record(), keep=(ROWS,), what="the linear plan")
    return result


def row_plans(model: nn.Module, by: str = BY_LOAD, again: bool = False, write: bool = True) -> dict[str, dict]:
    """Per format `model` computes in: its row-plan entry, as recorded, else (or when `again`)
    probed now and recorded unless not `write`. Applies nothing (`tune` does)."""
    path = plan_path(model)
    cached = measured.read_raw(path).get(ROWS)
    entries, measured_now = row_plan.plans_for(model, None if again else cached, by)
    if write:
        for key, entry in measured_now.items():
            measured.write_entry(path, ROWS, key, entry, what="the row plans")
    return entries
