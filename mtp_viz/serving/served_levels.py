"""The served half of `profile --backend vllm` (mtp_viz.served_costs): on one running server, C
closed-loop clients send the sweep's prompts, first with one output token a request (a round of C
prefills, as served: batched as they arrive, chunked where they exceed a step), then with
`new_tokens` each (ignore_eos); a decode step is the second round's time less the first's, over
the decode steps a request took (vLLM's per-request counts where the server drafts)."""

import asyncio
import statistics
from collections.abc import Callable

from mtp_viz.served_costs import Level
from mtp_viz.serving.client import Completion, completion_body
from mtp_viz.serving.in_vllm.forced_drafts import CODE_BASE
from mtp_viz.serving.levels import closed_loop

MIN_REQUESTS = 4  # requests a level sends at least (whole rounds of C)
SERVED_DRAFTS = (0, 1, 2, 3, 5)  # forced draft lengths served: k = d + 1 tokens scored a step
Progress = Callable[[str], None]


def bodies(name: str, prompts: list[list[int]], c: int, new_tokens: int, first: int | None = None) -> list[dict]:
    """Whole rounds of C requests cycling through the prompts (each led by `first`, where given:
    the forced drafter's length code)."""
    n = c * max(1, -(-MIN_REQUESTS // c))
    chosen = [prompts[i % len(prompts)] for i in range(n)]
    return [
        {**completion_body(name, ([first] if first is not None else []) + ids, new_tokens), "ignore_eos": True}
        for ids in chosen
    ]


def round_seconds(url: str, sent: list[dict], c: int) -> tuple[float, list[Completion]]:
    """(seconds a round of C requests takes in a closed loop of C clients, the completions)."""
    completions, wall = asyncio.run(closed_loop(url, sent, c))
    return wall * c / len(sent), completions


def decode_steps(c: Completion) -> int:
    """Decode steps of a completion: vLLM's per-step draft counts, else one a token after the first."""
    drafted = (c.spec or {}).get("per_step_drafted")
    return len(drafted) if drafted else max(1, len(c.token_ids) - 1)


def prefill_round(url: str, name: str, prompts: list[list[int]], c: int, first: int | None) -> tuple[float, float]:
    """(a round of C prefills as served, the mean prompt tokens it prefilled)."""
    sent = bodies(name, prompts, c, 1, first)
    seconds, _ = round_seconds(url, sent, c)
    return seconds, statistics.mean(len(b["prompt"]) for b in sent)


def level(
    url: str, name: str, prompts: list[list[int]], c: int, new_tokens: int, prefill: tuple[float, float], first=None
) -> Level:
    """One server at C: its decode step and round of prefills, as served."""
    seconds, completions = round_seconds(url, bodies(name, prompts, c, new_tokens, first), c)
    steps = statistics.mean(decode_steps(x) for x in completions)
    prefill_s, prompt_tokens = prefill
    return Level(max(0.0, seconds - prefill_s) / steps, prefill_s, prompt_tokens, steps)


def warm(url: str, name: str, prompts: list[list[int]], c: int) -> None:
    """Untimed: a fresh server's first steps of a shape pay one-off costs."""
    round_seconds(url, bodies(name, prompts, c, 4), c)


def server_levels(
    url: str, name: str, prompts: list[list[int]], sizes: tuple[int, ...], new_tokens: int, what: str, progress
) -> dict[int, Level]:
    """A server (plain, or a drafter's) at every C."""
    out = {}
    warm(url, name, prompts, max(sizes))
    for c in sizes:
        out[c] = level(url, name, prompts, c, new_tokens, prefill_round(url, name, prompts, c, None))
        if progress:
            progress(f"{what} as served, {c} clients: step {out[c].step_s * 1e3:.1f} ms")
    return out


def forced_levels(
    url: str, name: str, prompts: list[list[int]], sizes: tuple[int, ...], new_tokens: int, drafts, progress
) -> dict[int, dict[int, Level]]:
    """The forced drafter's server at every C and draft length d (k = d + 1 tokens scored a step);
    one round of prefills per C serves every k (the prompt is the same, the drafts come after)."""
    out: dict[int, dict[int, Level]] = {d + 1: {} for d in drafts}
    for c in sizes:
        prefill = prefill_round(url, name, prompts, c, CODE_BASE)
        for d in drafts:
            out[d + 1][c] = level(url, name, prompts, c, new_tokens, prefill, CODE_BASE + d)
            if progress:
                progress(f"speculative path as served, {c} clients, k = {d + 1}: {out[d + 1][c].step_s * 1e3:.1f} ms")
    return out
