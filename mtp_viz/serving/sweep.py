"""Speed under load, measured on a vLLM server: for each strategy one server, a warm-up, then the
same prompts from C concurrent clients (a closed loop: each client sends its next request when
its previous one is answered), for every C asked.

With a schedule (`auto`: recommended from the profile, this machine's own measured once where none
is given), each speculative strategy is also served at every fixed draft length up to its longest,
then with the table, and its recommended configuration gets rows of its own (`…:recommended`): at
each level, the table's measurement where it speculates, plain decoding's from where the
recommendation says to serve without speculation.

Writes, as it goes (a server that dies leaves the rows so far): `serving.csv`, one row per
(strategy, concurrency); `summary.json` naming the machine, the vLLM version and the settings;
and every request's trace under `traces/<strategy>/c<C>/`. `read_sweep` reads them back.
"""

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pandas as pd

from mtp_viz.errors import UserError
from mtp_viz.machine import machine_info
from mtp_viz.profile import ProfileView
from mtp_viz.prompts import BenchPrompt
from mtp_viz.runner import RunRequest
from mtp_viz.schedule import Recommendation, crossover, parse_table, to_vllm
from mtp_viz.serving.backend import VLLMPlan, open_server, plan, prompt_ids
from mtp_viz.serving.levels import mean_or_nan, measure_level, warm_up_concurrent
from mtp_viz.serving.machine_profile import drafters_of, machine_profile
from mtp_viz.serving.prediction import with_prediction
from mtp_viz.serving.scheduled import (
    AUTO,
    auto_schedule,
    draft_length,
    length_variant,
    recommended_label,
    scheduled_label,
    scheduled_plan,
)
from mtp_viz.serving.server import ServerError
from mtp_viz.strategies.variants import parse_variant
from mtp_viz.trace import Trace

CONCURRENCY = (1, 2, 4, 8, 16, 32)
SERVING_CSV = "serving.csv"
LEVEL_DONE = "measured"  # how a progress message that closes a level starts
SUMMARY_JSON = "summary.json"
BASELINE = "autoregressive"
MAX_CONCURRENCY = 256
COLUMNS = (
    "strategy",
    "concurrency",
    "requests",
    "new_tokens",
    "prompt_tokens",  # mean per request
    "wall_s",
    "tokens_per_s",  # all clients together
    "request_tokens_per_s",  # mean over requests of one request's tokens / its latency
    "speedup",  # tokens_per_s over vLLM autoregressive at the same concurrency
    "mean_accepted_tokens",  # tokens per target forward, the prefill step included (our definition)
    "vllm_mean_acceptance_length",  # vLLM's: 1 + accepted per verify step that drafted
    "acceptance_rate",
    "per_position_acceptance",
    "scored_per_forward",  # tokens a forward scores per sequence, on average (as the bench's)
    "ttft_s",
    "itl_s",
    "identical_to_ar",  # share of requests whose output equals vLLM AR's on the same prompt and C
    "counter_drafted",  # /metrics deltas over the level, for the cross-check
    "counter_accepted",
    "predicted_speedup",  # our load model with this device's profile (costs as served where measured)
    "served_as",  # a recommended configuration's row: the label whose measurement it is at this level
)


def sweep(
    prompts: list[BenchPrompt],
    labels: list[str],
    concurrency: list[int],
    base: RunRequest,
    out: Path,
    settings_for: Callable[[str], dict] = lambda s: {},
    url: str | None = None,
    progress: Callable[[str], None] | None = None,
    profile: ProfileView | None = None,
    schedule: str | None = None,
) -> pd.DataFrame:
    """Every strategy at every concurrency on vLLM (autoregressive first, the speedup baseline);
    with a schedule (`auto`: recommended from the profile and the acceptance measured here), each
    speculative strategy once more, served with it (mtp_viz.serving.scheduled)."""
    if not concurrency or any(not 1 <= c <= MAX_CONCURRENCY for c in concurrency):
        raise UserError(f"--concurrency takes integers 1..{MAX_CONCURRENCY}, separated by commas")
    if url and (len(labels) != 1 or schedule):
        raise UserError("a running server (--vllm-url) serves one strategy: give only that one, and no schedule")
    plans = _plans(labels if url else [BASELINE, *labels], base, settings_for)  # all checked before a server starts
    if schedule == AUTO:  # every fixed length up to each strategy's longest, measured beside the recommendation
        have = {(label.partition(":")[0], draft_length(p)) for label, p in plans.items()}
        lengths = [length_variant(x, k) for x in longest_per_strategy(plans) for k in range(1, draft_length(plans[x]))]
        extra = _plans(lengths, base, settings_for)
        plans |= {x: p for x, p in extra.items() if (x.partition(":")[0], draft_length(p)) not in have}
    fixed_table = parse_table(schedule) if schedule and schedule != AUTO else None
    meta: dict[str, Any] = {"machine": machine_info("cpu"), "prompts": [q.id for q in prompts], "errors": []}
    if schedule == AUTO and (profile is None or not profile.batch_cost):
        drafters = drafters_of([p.request for p in plans.values()])
        sizes = tuple(sorted(set(concurrency)))
        texts = [q.text for q in prompts]
        profile, where = machine_profile(base, drafters, texts, sizes, base.generation.max_new_tokens, progress)
        meta["profile"] = str(where)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    outputs: dict[tuple[str, int], list[list[int]]] = {}
    state = (prompts, concurrency, out, rows, outputs, meta, profile, progress)
    for label, p in plans.items():
        _measure(label, p, url, state)
    for label in longest_per_strategy(plans) if schedule else []:
        if fixed_table is not None:
            rec = Recommendation(fixed_table, None, {})
        else:
            table = _write(out, rows, outputs, meta, profile)
            rec = auto_schedule(table, profile, label, draft_length(plans[label]), max(concurrency))
        served = scheduled_plan(plans[label], rec.table) if rec.plain_from != 1 else None
        name = scheduled_label(label, rec.table)
        meta.setdefault("schedules", {})[name] = {
            "from": label,
            "num_speculative_tokens_per_batch_size": to_vllm(rec.table),
            "crossover": crossover(rec.table),
            "plain_from": rec.plain_from,
            "predicted": rec.predicted,
            "served": served is not None,
            "recommended": recommended_label(label) if schedule == AUTO else None,
        }
        if served is None and progress:
            progress(f"{name} never drafts: plain decoding's rows are its measurement")
        if served is not None:
            _measure(name, served, url, state)
        if schedule == AUTO:
            _recommended(recommended_label(label), name if served is not None else None, rec, state)
    return _write(out, rows, outputs, meta, profile)


def _plans(labels: list[str], base: RunRequest, settings_for: Callable[[str], dict]) -> dict[str, VLLMPlan]:
    """Each label's server plan (its request checked: a bad setting fails before any server)."""
    variants = {label: parse_variant(label) for label in dict.fromkeys(labels)}
    return {
        label: plan(replace(base, strategy=name, strategy_settings={**settings_for(name), **values}))
        for label, (name, values) in variants.items()
    }


def _recommended(label: str, scheduled: str | None, rec: Recommendation, state) -> None:
    """The recommended configuration's rows: at each level, the scheduled server's where it
    speculates, plain decoding's where it serves without speculation."""
    _, concurrency, out, rows, outputs, meta, profile, _ = state
    for c in concurrency:
        source = scheduled if scheduled is not None and rec.speculates_at(c) else BASELINE
        found = [r for r in rows if r["strategy"] == source and r["concurrency"] == c]
        if found and (source, c) in outputs:
            rows.append({**found[0], "strategy": label, "served_as": source})
            outputs[(label, c)] = outputs[(source, c)]
    _write(out, rows, outputs, meta, profile)


def longest_per_strategy(plans: dict[str, VLLMPlan]) -> list[str]:
    """Per speculative strategy, its label with the longest draft (what a schedule is built on)."""
    best: dict[str, str] = {}
    for label, p in plans.items():
        name = label.partition(":")[0]
        if p.speculative_config is not None and (name not in best or draft_length(p) > draft_length(plans[best[name]])):
            best[name] = label
    return list(best.values())


def _measure(label: str, p: VLLMPlan, url: str | None, state) -> None:
    """One strategy's server, a warm-up, then every concurrency level; rows written as they come."""
    prompts, concurrency, out, rows, outputs, meta, profile, progress = state
    ids = [prompt_ids(p, q.text) for q in prompts]
    texts = [q.text for q in prompts]
    try:
        with open_server(p, url, progress) as server:
            threads = p.served(server).machine["threads"]  # vLLM's CPU worker's, not ours
            meta.setdefault("vllm", server.version)
            meta["machine"]["threads"] = threads  # not ours; dropped where its log did not say
            if threads is None:
                meta["machine"].pop("threads")
            meta.setdefault("servers", {})[label] = {"args": server.args, "threads": threads}
            warm_up_concurrent(server, p, ids, max(concurrency))
            for c in concurrency:
                if progress:
                    progress(f"{label}: {c} concurrent client{'s' * (c > 1)}")
                point, order = measure_level(server, p, label, ids, c, texts)
                rows.append(point.row())
                if progress:
                    progress(f"{LEVEL_DONE} {label} at {c}: {rows[-1]['tokens_per_s']:.1f} tokens/s")
                outputs[(label, c)] = [t.output_token_ids for t in point.traces]
                _save_traces(out, label, c, point.traces, [prompts[i].id for i in order])
                _write(out, rows, outputs, meta, profile)
    except (UserError, httpx.HTTPError) as e:  # a server that died, a response that does not fit
        meta["errors"].append(f"{label}: {e}")
        _write(out, rows, outputs, meta, profile)
        raise ServerError(f"{label} stopped: {e} (results so far in {out})") from None


def trace_folder(out: Path, label: str, c: int) -> Path:
    """Where a sweep into `out` keeps the traces of one strategy (label) at concurrency c."""
    return out / "traces" / label.replace(":", "_").replace("=", "-").replace(",", "+") / f"c{c}"


def _save_traces(out: Path, label: str, c: int, traces: list[Trace], ids: list[str]) -> None:
    folder = trace_folder(out, label, c)
    folder.mkdir(parents=True, exist_ok=True)
    for n, (t, prompt_id) in enumerate(zip(traces, ids, strict=True)):
        t.save(folder / f"{n:03d}-{prompt_id}.json")


def _write(out: Path, rows: list[dict], outputs: dict, meta: dict, profile) -> pd.DataFrame:
    table = pd.DataFrame(rows, columns=list(COLUMNS))
    for i, row in table.iterrows():
        key = (BASELINE, row["concurrency"])
        base = table[(table["strategy"] == BASELINE) & (table["concurrency"] == row["concurrency"])]
        if not base.empty:
            table.loc[i, "speedup"] = row["tokens_per_s"] / base["tokens_per_s"].iloc[0]
        if key in outputs:
            mine = outputs[(row["strategy"], row["concurrency"])]
            table.loc[i, "identical_to_ar"] = mean_or_nan(
                [float(a == b) for a, b in zip(mine, outputs[key], strict=True)]
            )
    if profile is not None:
        table = with_prediction(table, profile.batch_cost, profile.draft_costs(), profile.prefill(), profile.served)
    table.to_csv(out / SERVING_CSV, index=False)
    (out / SUMMARY_JSON).write_text(json.dumps(meta, indent=1))
    return table


def read_sweep(folder: str | Path) -> tuple[pd.DataFrame, dict]:
    """A sweep's serving.csv and summary.json (what `bench --backend vllm` writes)."""
    folder = Path(folder)
    try:
        table = pd.read_csv(folder / SERVING_CSV)
        meta = json.loads((folder / SUMMARY_JSON).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(
            f"not a serving sweep ({SERVING_CSV} and {SUMMARY_JSON} from bench --backend vllm): {e}"
        ) from None
    missing = {"strategy", "concurrency", "tokens_per_s", "speedup"} - set(table.columns)
    if missing:
        raise UserError(f"{folder / SERVING_CSV} lacks the columns {', '.join(sorted(missing))}")
    return table, meta
