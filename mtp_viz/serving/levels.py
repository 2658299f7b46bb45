"""One concurrency level on a vLLM server: C clients in a closed loop (each sends its next request
when its previous one is answered), the engine's counters read once they have settled, and the
level's row of throughput, latency and acceptance."""

import asyncio
import json
import math
import time
from dataclasses import dataclass
from typing import Any

import httpx

from mtp_viz.serving.backend import VLLMPlan, request_body, to_trace
from mtp_viz.serving.client import ACCEPTED, DRAFTED, Completion, complete_async, spec_counters
from mtp_viz.serving.server import VLLMServer
from mtp_viz.trace import Trace, depth_counts


@dataclass(frozen=True)
class LoadPoint:
    """One strategy at one concurrency: what its requests returned and took; `row` is its line of
    serving.csv."""

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
            "prompt_tokens": mean_or_nan([len(c.prompt_token_ids) for c in self.completions]),
            "wall_s": self.wall_s,
            "tokens_per_s": tokens / self.wall_s if self.wall_s > 0 else math.nan,
            "request_tokens_per_s": mean_or_nan(
                [len(c.token_ids) / c.wall_s for c in self.completions if c.wall_s > 0]
            ),
            "mean_accepted_tokens": tokens / forwards if forwards else math.nan,
            "vllm_mean_acceptance_length": mean_or_nan([x for x in vllm_al if x is not None]),
            "acceptance_rate": accepted / drafted if drafted else math.nan,
            "per_position_acceptance": json.dumps([round(k / n, 4) for k, n in zip(kept, judged, strict=True)]),
            "scored_per_forward": (forwards + drafted) / forwards if forwards else math.nan,
            "ttft_s": mean_or_nan([c.ttft_s for c in self.completions if c.ttft_s is not None]),
            "itl_s": mean_or_nan([c.inter_token_s for c in self.completions if c.inter_token_s is not None]),
            "counter_drafted": self.counters.get(DRAFTED, 0.0),
            "counter_accepted": self.counters.get(ACCEPTED, 0.0),
        }


def mean_or_nan(values: list[float]) -> float:
    """The mean, NaN where there is nothing to average."""
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
