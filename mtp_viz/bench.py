"""Prompt suites → traces → pandas tables: every strategy on the same prompts, in the same order,
with autoregressive decoding in the same invocation as the baseline of every speedup."""

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd

from mtp_viz.errors import UserError
from mtp_viz.prompts import spec_bench
from mtp_viz.quality import first_divergence
from mtp_viz.runner import RunRequest, run
from mtp_viz.strategies import STRATEGIES, get_strategy
from mtp_viz.trace import Trace

SUITES = ("spec-bench",)
BASELINE = "autoregressive"


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    text: str


def load_suite(suite: str, categories: list[str] | None = None, limit: int | None = None) -> list[BenchPrompt]:
    """The first turn of each question; `limit` applies per category."""
    if suite not in SUITES:
        raise UserError(f"unknown suite {suite!r}; choose one of: {', '.join(SUITES)}")
    known = sorted({q["category"] for q in spec_bench()})
    unknown = sorted(set(categories or []) - set(known))
    if unknown:
        raise UserError(f"unknown categories {', '.join(unknown)}; Spec-Bench has: {', '.join(known)}")
    taken: dict[str, int] = {}
    prompts = []
    for q in spec_bench():
        c = q["category"]
        if categories and c not in categories:
            continue
        if limit is not None and taken.get(c, 0) >= limit:
            continue
        taken[c] = taken.get(c, 0) + 1
        prompts.append(BenchPrompt(str(q["question_id"]), c, q["turns"][0]))
    return prompts


def run_bench(
    prompts: list[BenchPrompt],
    strategies: list[str],
    base: RunRequest,
    settings_for: Callable[[str], dict] = lambda s: {},
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, list[Trace]]:
    """strategy → one trace per prompt. Autoregressive runs first on each prompt; one warm-up run
    before any timing is kept."""
    for s in strategies:
        get_strategy(s)
    order = [BASELINE] + [s for s in dict.fromkeys(strategies) if s != BASELINE]
    run(replace(base, prompt=prompts[0].text, strategy=BASELINE))  # warm-up, not recorded
    traces: dict[str, list[Trace]] = {s: [] for s in order}
    total, done = len(prompts) * len(order), 0
    for p in prompts:
        for s in order:
            traces[s].append(run(replace(base, prompt=p.text, strategy=s, strategy_settings=settings_for(s))))
            done += 1
            if progress:
                progress(done, total)
    return traces


def results_table(prompts: list[BenchPrompt], traces: dict[str, list[Trace]]) -> pd.DataFrame:
    """One row per (strategy, prompt) with the trace's metrics and its agreement with autoregressive."""
    rows = []
    for strategy, runs in traces.items():
        for p, t, ref in zip(prompts, runs, traces[BASELINE], strict=True):
            s = t.summary
            div = first_divergence(ref.output_token_ids, t.output_token_ids)
            rows.append(
                {
                    "strategy": strategy,
                    "prompt_id": p.id,
                    "category": p.category,
                    "new_tokens": s["new_tokens"],
                    "wall_time_s": s["wall_time_s"],
                    "target_forwards": s["target_forwards"],
                    "drafted_tokens": s["drafted_tokens"],
                    "accepted_tokens": s["accepted_tokens"],
                    "identical": div is None,
                    "agreement": _agreement(ref.output_token_ids, t.output_token_ids),
                    "lossless": STRATEGIES[strategy].is_lossless(t.settings),
                }
            )
    return pd.DataFrame(rows)


def _agreement(ref: list[int], out: list[int]) -> float:
    """Share of the reference's tokens reproduced before the first divergence."""
    div = first_divergence(ref, out)
    return 1.0 if div is None else div / max(1, len(ref))


def summary_table(results: pd.DataFrame) -> pd.DataFrame:
    """Per category and overall: tokens/s (total tokens / total time), speedup over autoregressive,
    mean accepted tokens, acceptance rate, share of outputs identical to autoregressive."""
    frames = [results, results.assign(category="overall")]
    g = pd.concat(frames).groupby(["category", "strategy"], sort=False)
    out = pd.DataFrame(
        {
            "prompts": g["prompt_id"].count(),
            "tokens_per_s": g["new_tokens"].sum() / g["wall_time_s"].sum(),
            "mean_accepted_tokens": g["new_tokens"].sum() / g["target_forwards"].sum(),
            "acceptance_rate": g["accepted_tokens"].sum() / g["drafted_tokens"].sum().where(lambda x: x > 0),
            "identical_share": g["identical"].mean(),
            "agreement": g["agreement"].mean(),
        }
    ).reset_index()
    base = out[out["strategy"] == BASELINE].set_index("category")["tokens_per_s"]
    out["speedup"] = out["tokens_per_s"] / out["category"].map(base)
    return out


def save(out_dir: Path, prompts: list[BenchPrompt], traces: dict[str, list[Trace]]) -> pd.DataFrame:
    """Writes results.csv, summary.csv, summary.json and traces/<strategy>/<prompt id>.json."""
    results = results_table(prompts, traces)
    summary = summary_table(results)
    out_dir.mkdir(parents=True, exist_ok=True)
    results.to_csv(out_dir / "results.csv", index=False)
    summary.to_csv(out_dir / "summary.csv", index=False)
    (out_dir / "summary.json").write_text(json.dumps(summary.to_dict(orient="records"), indent=1))
    for strategy, runs in traces.items():
        folder = out_dir / "traces" / strategy
        folder.mkdir(parents=True, exist_ok=True)
        for p, t in zip(prompts, runs, strict=True):
            t.save(folder / f"{p.id}.json")
    return summary
