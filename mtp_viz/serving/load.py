"""Speed under load, measured on a vLLM server: for each strategy one server, a warm-up, then the
same prompts from C concurrent clients (a closed loop: each client sends its next request when
its previous one is answered), for every C asked.

Writes, as it goes (a server that dies leaves the rows so far): `serving.csv`, one row per
(strategy, concurrency); `summary.json` naming the machine, the vLLM version and the settings;
and every request's trace under `traces/<strategy>/c<C>/`.
"""

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pandas as pd

from mtp_viz.bench import BenchPrompt
from mtp_viz.errors import UserError
from mtp_viz.machine import machine_info
from mtp_viz.quality import first_divergence
from mtp_viz.runner import RunRequest, parse_variant, run
from mtp_viz.serving.backend import VLLMPlan, open_server, plan, prompt_ids, request_body, to_trace
from mtp_viz.serving.client import ACCEPTED, DRAFTED, Completion, complete_async, spec_counters
from mtp_viz.serving.methods import served
from mtp_viz.serving.server import ServerError, VLLMServer
from mtp_viz.theory import concurrency_speedup, interpolated
from mtp_viz.trace import Trace, depth_counts

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
    "predicted_speedup",  # our load model (mtp_viz.theory) with this device's B × k profile
)


@dataclass(frozen=True)
class LoadPoint:
    label: str
    concurrency: int
    traces: list[Trace]
    completions: list[Completion]
    wall_s: float
    counters: dict[str, float]  # /metrics deltas

    def row(self) -> dict[str, Any]:
        tokens = sum(len(c.token_ids) for c in self.completions)
        steps = [s for t in self.traces for s in t.steps]
        forwards = len(steps)
        drafted = sum(len(s.drafted) for s in steps)
        accepted = sum(s.accepted for s in steps)
        judged, kept = depth_counts(steps)
        vllm_al = [t.machine.get("vllm_mean_acceptance_length") for t in self.traces]
        return {
            "strategy": self.label,
            "concurrency": self.concurrency,
            "requests": len(self.completions),
            "new_tokens": tokens,
            "wall_s": self.wall_s,
            "tokens_per_s": tokens / self.wall_s if self.wall_s > 0 else math.nan,
            "request_tokens_per_s": _mean([len(c.token_ids) / c.wall_s for c in self.completions if c.wall_s > 0]),
            "mean_accepted_tokens": tokens / forwards if forwards else math.nan,
            "vllm_mean_acceptance_length": _mean([x for x in vllm_al if x is not None]),
            "acceptance_rate": accepted / drafted if drafted else math.nan,
            "per_position_acceptance": json.dumps([round(k / n, 4) for k, n in zip(kept, judged, strict=True)]),
            "scored_per_forward": (forwards + drafted) / forwards if forwards else math.nan,
            "ttft_s": _mean([c.ttft_s for c in self.completions if c.ttft_s is not None]),
            "itl_s": _mean([c.inter_token_s for c in self.completions if c.inter_token_s is not None]),
            "counter_drafted": self.counters.get(DRAFTED, 0.0),
            "counter_accepted": self.counters.get(ACCEPTED, 0.0),
        }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


async def closed_loop(url: str, bodies: list[dict], concurrency: int) -> tuple[list[Completion], float]:
    """Send every body, `concurrency` at a time, each client sending its next when answered.
    Returns the completions in body order and the wall time from first send to last answer."""
    results: list[Completion | None] = [None] * len(bodies)
    queue = iter(range(len(bodies)))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits) as client:

        async def worker():
            for i in queue:
                results[i] = await complete_async(client, url, bodies[i])

        loop = asyncio.get_running_loop()
        start = loop.time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = loop.time() - start
    return results, wall


def requests_for(prompts: list[list[int]], concurrency: int) -> list[int]:
    """Prompt indices for one level: every prompt, cycled to a whole number (at least 2, but for
    one client) of requests per client, so that the clients stay busy together and the level's
    throughput is not the tail of a few stragglers."""
    rounds = max(math.ceil(len(prompts) / concurrency), 2 if concurrency > 1 else 1)
    return [i % len(prompts) for i in range(rounds * concurrency)]


def measure_level(server: VLLMServer, p: VLLMPlan, label: str, ids: list[list[int]], c: int, texts: list[str]):
    order = requests_for(ids, c)
    bodies = [request_body(p, ids[i]) for i in order]
    before = spec_counters(server.url)
    completions, wall = asyncio.run(closed_loop(server.url, bodies, c))
    reported = sum((comp.spec or {}).get("num_draft_tokens", 0) for comp in completions)
    counters = settled_counters(server.url, before, reported)
    traces = [to_trace(p, server, comp, texts[i]) for comp, i in zip(completions, order, strict=True)]
    return LoadPoint(label, c, traces, completions, wall, counters), order


def settled_counters(url: str, before: dict[str, float], drafted: float, timeout_s: float = 10.0) -> dict[str, float]:
    """The counters' growth since `before`, read once they count the `drafted` tokens the responses
    reported (the engine publishes them a moment after answering), or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = spec_counters(url)
        deltas = {k: v - before.get(k, 0.0) for k, v in now.items()}
        if deltas.get(DRAFTED, 0.0) >= drafted or time.monotonic() > deadline:
            return deltas
        time.sleep(0.2)


def warm_up_concurrent(server: VLLMServer, p: VLLMPlan, ids: list[list[int]], concurrency: int) -> None:
    """Untimed requests first: the first ones on a fresh server pay one-off costs."""
    n = max(2, min(concurrency, 4))
    bodies = [{**request_body(p, ids[i % len(ids)]), "max_tokens": 16} for i in range(n)]
    asyncio.run(closed_loop(server.url, bodies, n))


def sweep(
    prompts: list[BenchPrompt],
    labels: list[str],
    concurrency: list[int],
    base: RunRequest,
    out: Path,
    settings_for: Callable[[str], dict] = lambda s: {},
    url: str | None = None,
    progress: Callable[[str], None] | None = None,
    profile: tuple[dict[int, dict[int, float]], float | None] | None = None,
) -> pd.DataFrame:
    """Every strategy at every concurrency on vLLM (autoregressive first, the speedup baseline)."""
    if not concurrency or any(not 1 <= c <= MAX_CONCURRENCY for c in concurrency):
        raise UserError(f"--concurrency takes integers 1..{MAX_CONCURRENCY}, separated by commas")
    if url and len(labels) != 1:
        raise UserError("a running server (--vllm-url) serves one strategy: give only that one to --strategies")
    variants = {label: parse_variant(label) for label in dict.fromkeys(labels if url else [BASELINE, *labels])}
    plans = {
        label: plan(replace(base, strategy=name, strategy_settings={**settings_for(name), **values}))
        for label, (name, values) in variants.items()
    }  # every request checked before any server starts
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    outputs: dict[tuple[str, int], list[list[int]]] = {}
    meta: dict[str, Any] = {"machine": machine_info("cpu"), "prompts": [q.id for q in prompts], "errors": []}
    for label, p in plans.items():
        ids = [prompt_ids(p, q.text) for q in prompts]
        texts = [q.text for q in prompts]
        try:
            with open_server(p, url, progress) as server:
                threads = p.served(server).machine["threads"]  # vLLM's CPU worker's, not ours
                meta.setdefault("vllm", server.version)
                meta["machine"]["threads"] = threads
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
    return _write(out, rows, outputs, meta, profile)


def _folder(label: str) -> str:
    return label.replace(":", "_").replace("=", "-").replace(",", "+")


def _save_traces(out: Path, label: str, c: int, traces: list[Trace], ids: list[str]) -> None:
    folder = out / "traces" / _folder(label) / f"c{c}"
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
            table.loc[i, "identical_to_ar"] = _mean([float(a == b) for a, b in zip(mine, outputs[key], strict=True)])
    if profile is not None:
        table = with_prediction(table, *profile)
    table.to_csv(out / SERVING_CSV, index=False)
    (out / SUMMARY_JSON).write_text(json.dumps(meta, indent=1))
    return table


def predicted(row: pd.Series, batch_cost: dict[int, dict[int, float]], c: float | None) -> float:
    """Our load model's speedup for this row's strategy at its concurrency (mtp_viz.theory), from
    the tokens per forward vLLM measured at one client, as the Deploy? view predicts it."""
    b = int(row["concurrency"])
    if b not in batch_cost or pd.isna(row["mean_accepted_tokens"]):
        return math.nan
    drafting = uses_draft(row["strategy"])  # a draft forward per drafted token
    if drafting and c is None:
        return math.nan
    drafts = float(row["scored_per_forward"]) - 1.0 if drafting else 0.0
    tokens, scored = float(row["mean_accepted_tokens"]), float(row["scored_per_forward"])
    return concurrency_speedup(tokens, scored, drafts, c or 0.0, {b: batch_cost[b]})[b]


DRAFTING = ("speculative", "eagle")  # a drafter forward per drafted token: its cost ratio c counts


def uses_draft(label: str) -> bool:
    return str(label).partition(":")[0] in DRAFTING  # a label is "strategy[:name=value...]"


def engine_draft_cost(table: pd.DataFrame, batch_cost: dict[int, dict[int, float]]) -> dict[str, float]:
    """c as the serving engine pays it, per draft-model label, from its single-client row: a step
    costs (tokens per forward / speedup) autoregressive steps; less the verify cost our profile
    gives for the tokens it scored, per draft forward. Our engine's c (the profile's) leaves out
    what the serving engine spends on each draft step besides the draft's layers."""
    costs = {}
    for _, row in table[(table["concurrency"] == 1) & table["strategy"].map(uses_draft)].iterrows():
        drafts = float(row["scored_per_forward"]) - 1.0
        if 1 not in batch_cost or drafts <= 0 or pd.isna(row["speedup"]):
            continue
        step = float(row["mean_accepted_tokens"]) / float(row["speedup"])
        costs[row["strategy"]] = max(
            0.0, (step - interpolated(batch_cost[1], float(row["scored_per_forward"]))) / drafts
        )
    return costs


ENGINES_CSV = "engines.csv"


def after_prefill(t: Trace) -> float:
    """Tokens per forward without the first step. vLLM's prefill never drafts, while our prompt
    lookup may draft from the prompt in its first forward: without it the two count alike."""
    rest = t.steps[1:]
    return sum(len(s.emitted) for s in rest) / len(rest) if rest else math.nan


def compare_engines(
    prompts: list[BenchPrompt],
    labels: list[str],
    base: RunRequest,
    out: Path,
    settings_for: Callable[[str], dict] = lambda s: {},
) -> pd.DataFrame:
    """Our engine on the same prompts and settings (greedy, one request at a time, after the
    servers stopped) beside vLLM's single-client run: the same text?, tokens per forward of each,
    and their speeds as a ratio. Writes engines.csv (per prompt); returns the per-strategy means."""
    rows = []
    run(replace(base, prompt=prompts[0].text, strategy=BASELINE))  # warm-up, not recorded
    for label in dict.fromkeys([BASELINE, *labels]):
        name, values = parse_variant(label)
        folder = out / "traces" / _folder(label) / "c1"
        recorded = sorted(folder.glob("*.json"))[: len(prompts)] if folder.is_dir() else []
        if len(recorded) < len(prompts):
            raise UserError("the cross-engine check needs the single-client level: include 1 in --concurrency")
        for q, path in zip(prompts, recorded, strict=True):
            theirs = Trace.load(path)
            mine = served(name).served_values({**settings_for(name), **values})  # what vLLM ran (eagle: its chain)
            ours = run(replace(base, prompt=q.text, strategy=name, strategy_settings=mine))
            rows.append(
                {
                    "strategy": label,
                    "prompt_id": q.id,
                    "identical_text": ours.output_text == theirs.output_text,
                    "first_divergence": first_divergence(ours.output_token_ids, theirs.output_token_ids),
                    "ours_tokens_per_forward": ours.summary["mean_accepted_tokens"],
                    "vllm_tokens_per_forward": theirs.summary["mean_accepted_tokens"],
                    "ours_after_prefill": after_prefill(ours),
                    "vllm_after_prefill": after_prefill(theirs),
                    "ours_tokens_per_s": ours.summary["tokens_per_s"],
                    "vllm_tokens_per_s": theirs.summary["tokens_per_s"],
                }
            )
    per_prompt = pd.DataFrame(rows)
    per_prompt.to_csv(out / ENGINES_CSV, index=False)
    g = per_prompt.groupby("strategy", sort=False)
    return pd.DataFrame(
        {
            "identical_text": g["identical_text"].mean(),
            "ours_tokens_per_forward": g["ours_tokens_per_forward"].mean(),
            "vllm_tokens_per_forward": g["vllm_tokens_per_forward"].mean(),
            "ours_after_prefill": g["ours_after_prefill"].mean(),
            "vllm_after_prefill": g["vllm_after_prefill"].mean(),
            "ours_over_vllm_speed": g["ours_tokens_per_s"].mean() / g["vllm_tokens_per_s"].mean(),
        }
    ).reset_index()


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


def with_prediction(
    table: pd.DataFrame, batch_cost: dict[int, dict[int, float]] | None, c: float | None
) -> pd.DataFrame:
    """The sweep's rows with our load model's prediction from a profile (`predicted_speedup`), the
    same with the draft's cost measured on the serving engine at one client (`calibrated_speedup`;
    `engine_c`), and how far off each is ((predicted − measured) / measured); NaN where the
    profile has no timings for that concurrency."""
    table = table.copy()
    batch_cost = batch_cost or {}
    engine_c = engine_draft_cost(table, batch_cost)
    table["engine_c"] = table["strategy"].map(engine_c)
    table["predicted_speedup"] = [predicted(row, batch_cost, c) for _, row in table.iterrows()]
    table["calibrated_speedup"] = [
        predicted(row, batch_cost, engine_c.get(row["strategy"], c)) for _, row in table.iterrows()
    ]
    for column, error in (("predicted_speedup", "prediction_error"), ("calibrated_speedup", "calibrated_error")):
        table[error] = (table[column] - table["speedup"]) / table["speedup"]
    return table
