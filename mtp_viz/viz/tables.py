"""Traces → pandas tables. The column schema is declared once; everything else derives from it."""

import html

import pandas as pd

from mtp_viz.labels import BENCH_COLUMNS, peer_kind
from mtp_viz.machine import describe
from mtp_viz.trace import Trace

# column → (summary key or callable on the trace, format)
METRIC_COLUMNS = {
    "strategy": lambda t: t.strategy + (f" ({t.draft_model})" if t.draft_model else ""),
    "new tokens": "new_tokens",
    "tokens/s": "tokens_per_s",
    "target forwards": "target_forwards",
    "acceptance rate": "acceptance_rate",
    "mean accepted tokens": "mean_accepted_tokens",
    "wall time (s)": "wall_time_s",
}


DEPLOY_COLUMNS = {  # column → DeployCost field (mtp_viz.deploy), where the costs are known
    "extra models": "extra_models",
    "extra_params": "extra_params",
    "extra_memory_mb": "extra_memory_mb",
    "training": "training",
}


def metrics_table(traces: list[Trace], baseline: Trace | None = None, costs: list | None = None) -> pd.DataFrame:
    """One row per run; with `costs` (mtp_viz.deploy.deploy_costs), what each costs to deploy too."""
    rows = []
    for i, t in enumerate(traces):
        s = t.summary
        row = {col: (key(t) if callable(key) else s[key]) for col, key in METRIC_COLUMNS.items()}
        if baseline is not None:
            base = baseline.summary["tokens_per_s"]
            row["speedup"] = s["tokens_per_s"] / base if base else float("nan")
        if costs is not None:
            cost = costs[i]
            row.update({col: getattr(cost, key) if cost else None for col, key in DEPLOY_COLUMNS.items()})
        rows.append(row)
    df = pd.DataFrame(rows)
    for col in ("tokens/s", "acceptance rate", "mean accepted tokens", "wall time (s)", "speedup"):
        if col in df:
            df[col] = df[col].round(3)
    return df


def summary_html(trace: Trace, baseline_tokens_per_s: float | None = None) -> str:
    """The headline numbers of one run; speedup only where a matching baseline was measured."""
    s = trace.summary
    cells = [
        ("tokens/s", f"{s['tokens_per_s']:.1f}"),
        ("new tokens", str(s["new_tokens"])),
        ("target forwards", str(s["target_forwards"])),
        ("mean accepted tokens", f"{s['mean_accepted_tokens']:.2f}"),
        ("acceptance rate", f"{s['acceptance_rate']:.1%}" if s["drafted_tokens"] else "—"),
    ]
    against = ""
    if trace.strategy != "autoregressive":
        if baseline_tokens_per_s:
            cells.append(("speedup vs autoregressive", f"{s['tokens_per_s'] / baseline_tokens_per_s:.2f}x"))
            against = (
                f"speedup against the autoregressive run of the same prompt and settings in this session "
                f"({baseline_tokens_per_s:.1f} tokens/s)"
            )
        elif trace.machine.get("engine") == "vllm":
            cells.append(("speedup vs autoregressive", "not measured"))
            against = "one request on vLLM; its speedups over its own autoregressive decoding are in the Deploy? tab"
        else:
            cells.append(("speedup vs autoregressive", "not measured"))
            against = "no autoregressive run of this prompt yet: tick “Measure autoregressive too” for the speedup"
    body = "".join(
        f"<div style='display:inline-block;margin:0 18px 6px 0'><div style='font-size:12px;color:#6b7280'>"
        f"{html.escape(k)}</div><div style='font-size:20px;font-weight:600'>{html.escape(v)}</div></div>"
        for k, v in cells
    )
    who = html.escape(
        f"{trace.strategy} · {trace.model}"
        + (f" + {trace.draft_model}" if trace.draft_model else "")
        + f" · {trace.device} {trace.dtype} · stop: {trace.stop_reason}"
    )
    where = html.escape(f"measured on {describe(trace.machine)}")
    against = f"<br>{html.escape(against)}" if against else ""
    return f"<div>{body}</div><div style='font-size:12px;color:#6b7280'>{who}<br>{where}{against}</div>"


def bench_table(summary: pd.DataFrame) -> pd.DataFrame:
    """A bench summary (a row per category and strategy) → one row per strategy: the overall
    speedup, tokens per target forward and quality, then the speedup per category; transformers'
    peers marked, fastest first."""
    overall = summary[summary["category"] == "overall"].set_index("strategy")
    per_category = summary[summary["category"] != "overall"].pivot(
        index="strategy", columns="category", values="speedup"
    )
    table = pd.DataFrame(index=overall.index)
    table["kind"] = [peer_kind(s) for s in overall.index]
    for column, key in BENCH_COLUMNS.items():
        table[column] = overall[key] if key in overall else float("nan")  # older summaries lack some
    for category in dict.fromkeys(summary.loc[summary["category"] != "overall", "category"]):
        table[f"{category} speedup"] = per_category[category]
    table = table.sort_values("speedup", ascending=False).reset_index()
    return table.round(3)
