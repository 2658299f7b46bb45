"""Our engine beside vLLM on the same prompts and settings: the single-client traces a sweep
recorded, run again on our engine one request at a time, compared for text, tokens per forward
and speed."""

import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pandas as pd

from mtp_viz.errors import UserError
from mtp_viz.prompts import BenchPrompt
from mtp_viz.quality import first_divergence
from mtp_viz.runner import RunRequest, run
from mtp_viz.serving.methods import served
from mtp_viz.serving.sweep import BASELINE, trace_folder
from mtp_viz.strategies.variants import parse_variant
from mtp_viz.trace import Trace

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
        folder = trace_folder(out, label, 1)
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
