"""`profile --backend vllm`: what a step of B sequences × k tokens costs on the serving engine
itself, written in the profile format the Theory and Deploy? views read (mtp_viz.profile).

How vLLM is made to verify exactly k tokens per step: the server runs a drafter of our own
(`in_vllm/forced_drafts.py`, vLLM's `custom_class` speculative method) that proposes, for every
request at every step, as many tokens as the request's first prompt token asks for; the
per-request metrics (`per_step_drafted`) confirm it and are recorded (`forced_share`). B requests
with the same prompt length and output length (`ignore_eos`) start together, so they decode in
the same steps (all prefilled in one step); a step's time is vLLM's own decode interval of a
request over its decode steps, the median over the B requests. One server measures every (B, k);
a drafter's cost (the draft model, EAGLE-3) is what a step of its server costs beyond a forced
step scoring as many tokens.

Given the sweep's prompts, each server is also timed as the sweep serves it (served_levels: real
prompts in a closed loop, prefills mixed in), and a plain server beside them: the costs as served
(mtp_viz.served_costs) that the prediction and the recommendation read.
"""

import asyncio
import statistics
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from mtp_viz.loading import resolve_device
from mtp_viz.machine import machine_info
from mtp_viz.profile import BATCH_SIZES, Profile
from mtp_viz.prompts import spec_bench
from mtp_viz.runner import RunRequest
from mtp_viz.served_costs import NOT_MODELLED, TERMS, ServedCosts
from mtp_viz.serving.backend import VLLMPlan, open_server, plan, prompt_ids
from mtp_viz.serving.client import Completion, completion_body
from mtp_viz.serving.in_vllm.forced_drafts import CODE_BASE
from mtp_viz.serving.levels import closed_loop
from mtp_viz.serving.methods import server_args
from mtp_viz.serving.served_levels import SERVED_DRAFTS, forced_levels, server_levels
from mtp_viz.theory import interpolated

IN_VLLM = Path(__file__).with_name("in_vllm")  # on the server's PYTHONPATH
FORCED_METHOD = {"method": "custom_class", "model": "forced_drafts.ForcedDrafts"}
DRAFTS = (0, 1, 2, 3, 5, 7)  # draft lengths timed: k = d + 1 tokens per sequence (the profile's B × k grid)
DECODE_STEPS = 12  # decode steps each request is timed over
# prompt tokens per request: 32 of them (2048) fit one prefill step of vLLM's CPU server (its
# max_num_batched_tokens), so B requests started together decode in the same steps from the first
CONTEXT = 64
DRAFTER_LENGTH = 3  # draft length a drafter's server runs with when its cost is measured
DRAFTERS = ("speculative", "eagle")  # strategies whose drafter costs a forward per drafted token
SERVED_TOKENS = 64  # output tokens a request is timed over as served
Progress = Callable[[str], None]
Then = Callable[[str], Any] | None  # run on a server's url before it stops (the served timings)


def forced_plan(base: RunRequest, most: int) -> VLLMPlan:
    """The target's server with the forced drafter (up to `most` tokens per step)."""
    p = plan(replace(base, strategy="autoregressive", strategy_settings={}))
    spec = {**FORCED_METHOD, "num_speculative_tokens": most}
    env = {**p.server.env, "PYTHONPATH": str(IN_VLLM)}
    return replace(p, speculative_config=spec, server=replace(p.server, extra_args=tuple(server_args(spec)), env=env))


def filler(p: VLLMPlan, length: int) -> list[int]:
    """`length` prompt tokens: Spec-Bench first turns, tokenised and joined."""
    ids: list[int] = []
    for q in spec_bench():
        ids += prompt_ids(p, q["turns"][0])
        if len(ids) >= length:
            return ids[:length]
    return (ids * (length // max(1, len(ids)) + 1))[:length]


def step_seconds(c: Completion) -> tuple[float, int, list[int]]:
    """(seconds per decode step, decode steps, tokens drafted per step) of one completion: vLLM's
    decode interval (first to last output token) over its decode steps; the client's own times
    where the engine reported none."""
    metrics = c.metrics or {}
    drafted = list((c.spec or {}).get("per_step_drafted") or [])
    steps = len(drafted) or max(1, len(c.token_ids) - 1)
    if metrics.get("generation_time_ms") is not None:
        seconds = float(metrics["generation_time_ms"]) / 1000
    else:
        seconds = c.wall_s - (c.ttft_s or 0.0)
    return seconds / steps, steps, drafted


def time_level(url: str, body: dict, batch: int) -> tuple[float, list[int]]:
    """B copies of one request at once: (median seconds per decode step, drafts of every step)."""
    completions, _ = asyncio.run(closed_loop(url, [body] * batch, batch))
    timed = [step_seconds(c) for c in completions]
    return statistics.median(t for t, _, _ in timed), [d for _, _, drafted in timed for d in drafted]


def forced_costs(
    p: VLLMPlan,
    sizes: tuple[int, ...],
    drafts: tuple[int, ...],
    repeats: int,
    progress: Progress | None,
    then: Then = None,
) -> tuple[dict[int, dict[int, float]], dict[str, float], dict, Any]:
    """(B → k → seconds per step, k → share of steps that drafted exactly k − 1 (None: the server
    reported no per-step counts), the server's version and threads, what `then` returned)."""
    context = filler(p, CONTEXT - 1)
    times: dict[tuple[int, int], list[float]] = {}
    exact: dict[int, list[bool]] = {d: [] for d in drafts}
    with open_server(p, progress=progress) as server:
        threads = p.served(server).machine["threads"]  # vLLM's worker's (None: its log did not say)
        engine = {"vllm": server.version, **({"threads": threads} if threads is not None else {})}
        for b in (1, max(sizes)):  # untimed: a fresh server's first steps of a shape pay one-off costs
            time_level(server.url, body_for(p, [CODE_BASE + max(drafts), *context]), b)
        for _ in range(repeats):
            for b in sizes:
                for d in drafts:
                    body = body_for(p, [CODE_BASE + d, *context])
                    seconds, drafted = time_level(server.url, body, b)
                    times.setdefault((b, d + 1), []).append(seconds)
                    exact[d] += [n == d for n in drafted] if d else [True]
                    if progress:
                        progress(f"vLLM step, B = {b}, k = {d + 1}: {seconds * 1e3:.1f} ms")
        extra = then(server.url) if then else None
    steps = {b: {d + 1: statistics.median(times[b, d + 1]) for d in drafts} for b in sizes}
    return steps, {str(d + 1): sum(v) / len(v) if v else None for d, v in exact.items()}, engine, extra


def drafter_costs(
    p: VLLMPlan,
    steps: dict[int, dict[int, float]],
    sizes: tuple[int, ...],
    length: int,
    repeats: int,
    progress: Progress | None,
    then: Then = None,
) -> tuple[dict[int, float], Any]:
    """(B → one drafted token's drafter cost / T(B, 1): a step of the drafter's server beyond the
    forced step that scores as many tokens, per drafted token (medians over `repeats` rounds),
    what `then` returned)."""
    context = filler(p, CONTEXT)
    times: dict[int, list[float]] = {b: [] for b in sizes}
    with open_server(p, progress=progress) as server:
        time_level(server.url, body_for(p, context), max(sizes))  # untimed, as above
        for _ in range(repeats):
            for b in sizes:
                seconds, _ = time_level(server.url, body_for(p, context), b)
                times[b].append(seconds)
                if progress:
                    progress(f"vLLM drafter step, B = {b}, {length} drafts: {seconds * 1e3:.1f} ms")
        extra = then(server.url) if then else None
    cost = {}
    for b in sizes:
        forced = steps[b].get(length + 1, steps[b][max(steps[b])])
        cost[b] = max(0.0, (statistics.median(times[b]) - forced) / length / steps[b][1])
    return cost, extra


def body_for(p: VLLMPlan, ids: list[int]) -> dict:
    body = completion_body(p.target.name, ids, DECODE_STEPS + 1)
    return {**body, "ignore_eos": True}


def fit_step(steps: dict[int, dict[int, float]]) -> dict[str, float]:
    """Least squares of T(B, k) = fixed + per_sequence·B + per_token·B·k: the per-step fixed cost
    (scheduling, sampling, output handling) apart from what grows with the rows of the batch."""
    rows = [(1.0, float(b), float(b * k), t) for b, row in steps.items() for k, t in row.items()]
    n = 3
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    y = [sum(r[i] * r[3] for r in rows) for i in range(n)]
    for col in range(n):  # Gaussian elimination, partial pivoting
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot], y[col], y[pivot] = a[pivot], a[col], y[pivot], y[col]
        for r in range(n):
            if r != col and a[col][col]:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * z for x, z in zip(a[r], a[col], strict=True)]
                y[r] -= f * y[col]
    fixed, per_sequence, per_token = (y[i] / a[i][i] if a[i][i] else 0.0 for i in range(n))
    return {"fixed_s": fixed, "per_sequence_s": per_sequence, "per_token_s": per_token}


def engine_profile(
    base: RunRequest,
    sizes: tuple[int, ...] = BATCH_SIZES,
    drafts: tuple[int, ...] = DRAFTS,
    repeats: int = 1,
    drafters: dict[str, RunRequest] | None = None,
    progress: Progress | None = None,
    served_prompts: list[str] | None = None,
    new_tokens: int = SERVED_TOKENS,
) -> Profile:
    """The serving engine's B × k step costs (and each drafter's cost per B) as a Profile; with the
    sweep's prompts, also every server's costs as served (and a plain server's)."""
    forced = forced_plan(base, max(max(drafts), 1))
    ids = [prompt_ids(forced, text) for text in served_prompts] if served_prompts else None
    name = forced.target.name

    def as_served(what: str, forced_drafter: bool = False) -> Then:
        if not ids:
            return None
        if forced_drafter:
            return lambda url: forced_levels(url, name, ids, sizes, new_tokens, SERVED_DRAFTS, progress)
        return lambda url: server_levels(url, name, ids, sizes, new_tokens, what, progress)

    steps, exact, engine, forced_served = forced_costs(forced, sizes, drafts, repeats, progress, as_served("", True))
    draft_cost, names, drafter_served = {}, {}, {}
    for strategy, request in (drafters or {}).items():
        p = plan(replace(request, strategy_settings={**request.strategy_settings, **_length(strategy)}))
        draft_cost[strategy], drafter_served[strategy] = drafter_costs(
            p, steps, sizes, DRAFTER_LENGTH, repeats, progress, as_served(f"{strategy}'s drafter")
        )
        names[strategy] = p.draft_name
    served = None
    if ids:
        plain = plan(replace(base, strategy="autoregressive", strategy_settings={}))
        with open_server(plain, progress=progress) as server:
            plain_served = server_levels(server.url, name, ids, sizes, new_tokens, "plain serving", progress)
        lengths = {s: DRAFTER_LENGTH for s in drafter_served}
        served = ServedCosts(plain_served, forced_served, drafter_served, lengths, new_tokens)
    one = {b: row[1] for b, row in steps.items()}
    relative = {b: {k: t / row[1] for k, t in row.items()} for b, row in steps.items()}
    smallest = min(steps)
    speculative = draft_cost.get("speculative")
    device = resolve_device(base.device)
    return Profile(
        model=forced.target.name,
        draft_model=names.get("speculative"),
        device=device.type,
        dtype=forced.server.dtype,
        one_token_s=one[smallest],
        verify_cost={k: interpolated(relative[smallest], k) for k in range(1, max(relative[smallest]) + 1)},
        c=speculative[min(speculative)] if speculative else None,
        machine={
            **{k: v for k, v in machine_info(device).items() if k != "threads"},
            **engine,
            "engine": "vllm",
            "forced_drafts": forced.speculative_config,
        },
        batch_cost=relative,
        batch_one_token_s=one,
        engine="vllm",
        step_fit=fit_step(steps),
        draft_cost=draft_cost or None,
        drafters=names or None,
        forced_share=exact,
        served=served.as_dict() if served else None,
        how=how_measured(ids, new_tokens),
    )


def how_measured(ids: list[list[int]] | None, new_tokens: int) -> dict[str, str]:
    """How each figure of an engine profile was obtained (written into it)."""
    how = {
        "batch_cost": f"lockstep: B copies of one {CONTEXT}-token prompt started together, every step drafting the "
        f"same forced length, vLLM's decode interval over {DECODE_STEPS} steps (no prefill after the first step)",
        "draft_cost": f"each drafter's server at {DRAFTER_LENGTH} drafts, lockstep as above, beyond the forced step "
        "scoring as many tokens, per drafted token",
    }
    if ids:
        mean = sum(map(len, ids)) / len(ids)
        how["served"] = (
            f"as the sweep serves: C closed-loop clients cycling {len(ids)} prompts (mean {mean:.0f} tokens); a round "
            f"of one-token requests times the prefills; one of {new_tokens}-token requests (ignore_eos) less that, "
            "over a request's decode steps, times a decode step; on a plain server, the forced drafter's (every k) "
            "and each drafter's"
        )
        how["prediction models"] = "; ".join(TERMS)
        how["prediction leaves out"] = "; ".join(NOT_MODELLED)
    return how


def _length(strategy: str) -> dict:
    return {"depth": DRAFTER_LENGTH} if strategy == "eagle" else {"num_draft_tokens": DRAFTER_LENGTH}
