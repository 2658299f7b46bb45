"""A training run's curves as Markdown: Mermaid line charts (rendered where Markdown renders
Mermaid: GitHub, the Hugging Face Hub) of its training loss and of each agreement family per
step, and the history as a table, for docs/training.md. Written beside the report (curves.md)."""

import re
from collections.abc import Iterable

FAMILIES = (  # history keys → (chart title, its y-axis)
    (re.compile(r"^train_loss$"), "training loss (mean since the previous entry)", "loss"),
    (re.compile(r"^val_top1_(step|depth)\d+$"), "validation top-1 agreement with the target, per draft step", "top-1"),
    (re.compile(r"^heldout_top1_(step|depth)\d+$"), "held-out Spec-Bench answers: top-1 agreement, per step", "top-1"),
    (re.compile(r"^(val|heldout)_mean_accepted_tokens$"), "tokens a greedy chain yields per target forward", "tokens"),
)


def _number(v: float) -> str:
    return f"{v:.4g}"


def chart(history: list[dict], keys: list[str], title: str, axis: str) -> str:
    """One Mermaid xychart: a line per key over the steps of the entries that hold one (the legend
    below it); an entry that lacks a key repeats the line's previous value."""
    history = [h for h in history if any(k in h for k in keys)]
    steps = [h["step"] for h in history]
    values = [[h.get(k) for h in history] for k in keys]
    flat = [v for vs in values for v in vs if v is not None]
    low, high = min(flat), max(flat)
    pad = (high - low) * 0.05 or 0.05
    lines = [
        "```mermaid",
        "xychart-beta",
        f'    title "{title}"',
        f'    x-axis "optimizer step" [{", ".join(map(str, steps))}]',
        f'    y-axis "{axis}" {_number(max(0.0, low - pad))} --> {_number(high + pad)}',
        *(f"    line [{', '.join(_number(v) for v in _filled(vs))}]" for vs in values),
        "```",
    ]
    if len(keys) > 1:
        lines.append("Lines, in order: " + ", ".join(f"`{k}`" for k in keys) + ".")
    return "\n".join(lines)


def table(history: list[dict]) -> str:
    keys = list(dict.fromkeys(k for h in history for k in h))
    rows = [
        "| " + " | ".join(keys) + " |",
        "|" + "---|" * len(keys),
        *("| " + " | ".join(_number(h[k]) if k in h else "" for k in keys) + " |" for h in history),
    ]
    return "\n".join(rows)


def markdown(history: list[dict], title: str) -> str:
    """The run's charts, one per family of keys present, and its table."""
    if not history:
        return f"## {title}\n\nNo validation entries.\n"
    keys = list(dict.fromkeys(k for h in history for k in h if k != "step"))
    parts = [f"## {title}"]
    for pattern, name, axis in FAMILIES:
        family = _ordered(k for k in keys if pattern.match(k))
        if family:
            parts.append(chart(history, family, name, axis))
    parts.append(table(history))
    return "\n\n".join(parts) + "\n"


def _ordered(keys: Iterable[str]) -> list[str]:
    """Keys with a trailing number in that number's order (step2 before step10)."""
    return sorted(keys, key=lambda k: (re.sub(r"\d+$", "", k), int(m.group()) if (m := re.search(r"\d+$", k)) else 0))


def _filled(values: list[float | None]) -> list[float]:
    out, last = [], next((v for v in values if v is not None), 0.0)
    for v in values:
        last = v if v is not None else last
        out.append(last)
    return out
