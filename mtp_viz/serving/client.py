"""Requests to a vLLM server over HTTP: one streamed completion on token ids, and its Prometheus
counters. Plain data out; `mtp_viz.serving.traces` turns a completion into a Trace."""

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

REQUEST_TIMEOUT_S = 600.0
# vLLM's speculative-decoding counters on /metrics (summed over label sets)
STEPS, DRAFTED, ACCEPTED = (f"vllm:spec_decode_num_{n}" for n in ("drafts", "draft_tokens", "accepted_tokens"))
SPEC_COUNTERS = (STEPS, DRAFTED, ACCEPTED)
PER_POSITION_COUNTER = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class Completion:
    """One streamed completion as the client saw it: tokens, when they came, what vLLM reported."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    wall_s: float  # request sent → last byte
    ttft_s: float | None  # request sent → first generated token
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each chunk with tokens (from send)
    chunk_tokens: list[int] = field(default_factory=list)  # tokens each of those chunks carried
    metrics: dict[str, Any] | None = None  # the response's `metrics` (timing, speculative_decoding)
    usage: dict[str, Any] | None = None  # the response's `usage` (prompt and completion token counts)

    @property
    def spec(self) -> dict[str, Any] | None:
        return (self.metrics or {}).get("speculative_decoding")

    @property
    def inter_token_s(self) -> float | None:
        """Mean time between generated tokens after the first, as the client received them."""
        if self.ttft_s is None or len(self.token_ids) < 2:
            return None
        return (self.wall_s - self.ttft_s) / (len(self.token_ids) - 1)


def completion_body(
    served_name: str,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
) -> dict[str, Any]:
    body = {
        "model": served_name,
        "prompt": list(prompt_ids),  # token ids: the exact prompt our engine gets, chat template applied
        "max_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "stream": True,
        "stream_options": {"include_usage": True},  # the final chunk carries usage and metrics
        "return_token_ids": True,
        "skip_special_tokens": False,
    }
    if top_k:
        body["top_k"] = top_k
    if seed is not None and temperature > 0:
        body["seed"] = seed
    return body


def parse_stream(lines: Iterable[tuple[str, float]], sent: float, done: float) -> Completion:
    """Server-sent events of a streamed completion, each line with its arrival time → Completion.
    Times are on one clock: `sent` when the request left, `done` when the last byte came."""
    prompt, tokens, text, finish, metrics, usage = [], [], [], None, None, None
    times, counts = [], []
    for line, arrived in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk or chunk.get("object") == "error":
            error = chunk.get("error", chunk)
            raise httpx.HTTPError(f"vLLM error: {error.get('message', error) if isinstance(error, dict) else error}")
        for choice in chunk.get("choices") or []:
            prompt = choice.get("prompt_token_ids") or prompt
            new = choice.get("token_ids") or []
            if new:
                tokens.extend(new)
                times.append(arrived - sent)
                counts.append(len(new))
            text.append(choice.get("text") or "")
            finish = choice.get("finish_reason") or finish
        if chunk.get("metrics") is not None:
            metrics = chunk["metrics"]
        if chunk.get("usage") is not None:
            usage = chunk["usage"]
    return Completion(
        prompt_token_ids=[int(t) for t in prompt],
        token_ids=[int(t) for t in tokens],
        text="".join(text),
        finish_reason=finish,
        wall_s=done - sent,
        ttft_s=times[0] if times else None,
        chunk_times_s=times,
        chunk_tokens=counts,
        metrics=metrics,
        usage=usage,
    )


def _error(r: httpx.Response) -> httpx.HTTPStatusError:
    return httpx.HTTPStatusError(f"vLLM answered {r.status_code}: {r.text[:300]}", request=r.request, response=r)


def complete(client: httpx.Client, url: str, body: dict[str, Any]) -> Completion:
    sent = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as r:
        if r.status_code != 200:
            r.read()
            raise _error(r)
        lines = [(line, time.perf_counter()) for line in r.iter_lines()]
    return parse_stream(lines, sent, time.perf_counter())


async def complete_async(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Completion:
    sent = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as r:
        if r.status_code != 200:
            await r.aread()
            raise _error(r)
        lines = [(line, time.perf_counter()) async for line in r.aiter_lines()]
    return parse_stream(lines, sent, time.perf_counter())


def spec_counters(url: str) -> dict[str, float]:
    """vLLM's speculative-decoding counters now, from its /metrics."""
    return parse_counters(httpx.get(f"{url}/metrics", timeout=10).text)


def parse_counters(text: str) -> dict[str, float]:
    """Prometheus text → the speculative-decoding counters, summed over their label sets;
    per-position accepted counts as `...per_pos:<i>`."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        if name.endswith("_total"):
            name = name[: -len("_total")]
        if name in SPEC_COUNTERS:
            totals[name] = totals.get(name, 0.0) + float(value)
        elif name == PER_POSITION_COUNTER:
            position = name_labels.split('position="', 1)[1].split('"', 1)[0]
            key = f"{PER_POSITION_COUNTER}:{position}"
            totals[key] = totals.get(key, 0.0) + float(value)
    return totals
