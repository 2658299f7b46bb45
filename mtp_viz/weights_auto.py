"""`--weights auto`: the weight format (mtp_viz.weights) this machine runs a model fastest in,
among those that stay close enough to fp32, measured once and cached like the linear plan.

Close enough: greedy agreement with fp32 of at least AGREEMENT_FLOOR on held-out prompts
(Spec-Bench questions, one per category, which no training here used): fp32 writes a greedy
continuation, each format reads it teacher-forced, and agreement is the share of positions where
the format's greedy token is fp32's; the mean negative log-likelihood of fp32's tokens under the
format is kept beside it. Fastest: the median time of a one-token forward (head included) over
interleaved rounds (each round times every format back to back, so a busy machine hits them
alike); a format whose rounds spread beyond the linear plan's MAX_SPREAD is timed again, and a
comparison still noisy decides nothing: fp32 serves, for RETRY_AFTER_S, then a load measures
again. Lossless here: a format whose products no row plan makes row-invariant on this machine
(mtp_viz.row_plan, measured when it loads) is not chosen. The record says when, under what load,
with what agreement, speed and row plans.
"""

import logging
import statistics
import time
from pathlib import Path
from typing import Protocol

import torch

from mtp_viz import measured
from mtp_viz.cache import CachedModel
from mtp_viz.linear_plan import MAX_SPREAD, RETRIES, spread
from mtp_viz.machine import machine_info
from mtp_viz.prompts import spec_bench
from mtp_viz.row_plan import describe as describe_rows
from mtp_viz.row_plan import not_lossless
from mtp_viz.weights import FORMATS, FP32

log = logging.getLogger(__name__)

AGREEMENT_FLOOR = 0.99
PROMPTS = 13  # held-out prompts: the first question of each Spec-Bench category (832 positions in all:
NEW_TOKENS = 64  # one miss moves agreement by 0.12%, so 8 × 32 was too coarse for a 99% floor)
ROUNDS = 5  # timed rounds, after one warm-up
FORWARDS = 8  # one-token forwards per format per round
RECORD_VERSION = 3  # 1 scored 8 prompts × 32 tokens; 2 did not say which formats are lossless here


class Loaded(Protocol):  # mtp_viz.loading.LoadedModel, as far as this module reads it
    model: torch.nn.Module
    tokenizer: object
    chat: bool


def held_out_prompts(count: int = PROMPTS) -> list[str]:
    """The first Spec-Bench question of each of the first `count` categories (sorted by name)."""
    firsts: dict[str, str] = {}
    for q in spec_bench():
        firsts.setdefault(q["category"], q["turns"][0])
    return [firsts[c] for c in sorted(firsts)[:count]]


def encode(loaded: Loaded, prompt: str) -> list[int]:
    tok = loaded.tokenizer
    if loaded.chat and tok.chat_template:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        return list(ids["input_ids"] if not isinstance(ids, list) else ids)
    return tok(prompt)["input_ids"]


@torch.inference_mode()
def greedy(model: torch.nn.Module, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """`new_tokens` greedy tokens after the prompt, through the engine (CachedModel)."""
    cached, seq = CachedModel(model), list(prompt_ids)
    for _ in range(new_tokens):
        seq.append(int(cached.forward(seq)[-1].argmax()))
    return seq[len(prompt_ids) :]


@torch.inference_mode()
def scored(model: torch.nn.Module, prompt_ids: list[int], output: list[int]) -> tuple[int, float]:
    """(positions where `model`'s greedy token is output's, summed NLL of output) teacher-forced."""
    logits = CachedModel(model).forward(prompt_ids + output, logits_to_keep=len(output) + 1)[:-1]  # (n, V)
    target = torch.tensor(output, device=logits.device)
    nll = torch.nn.functional.cross_entropy(logits, target, reduction="sum")
    return int((logits.argmax(-1) == target).sum()), float(nll)


def quality(reference: Loaded, others: dict[str, Loaded], prompts: list[str], new_tokens: int = NEW_TOKENS) -> dict:
    """Per format: agreement with `reference`'s greedy tokens and mean NLL of them, teacher-forced."""
    totals = {fmt: [0, 0.0] for fmt in others}
    positions = 0
    for prompt in prompts:
        ids = encode(reference, prompt)
        output = greedy(reference.model, ids, new_tokens)
        positions += len(output)
        for fmt, other in others.items():
            agree, nll = scored(other.model, ids, output)
            totals[fmt][0] += agree
            totals[fmt][1] += nll
    return {
        fmt: {"agreement": round(a / positions, 4), "nll": round(n / positions, 4), "positions": positions}
        for fmt, (a, n) in totals.items()
    }


@torch.inference_mode()
def forward_times(
    models: dict[str, torch.nn.Module], prompt_ids: list[int], rows: int = 1, rounds: int = ROUNDS
) -> dict[str, list[float]]:
    """Seconds per forward of `rows` new tokens after the prompt, per format, as a strategy's
    verify runs them (rows attending one at a time, logits for every row), in interleaved rounds
    (which format goes first rotates round by round); round 0 warms up and is dropped."""
    cached = {fmt: CachedModel(m, prompt_length=len(prompt_ids)) for fmt, m in models.items()}
    for c in cached.values():
        c.forward(prompt_ids)
    extra = prompt_ids[:rows]
    times: dict[str, list[float]] = {fmt: [] for fmt in models}
    order = list(models)
    for round_ in range(rounds + 1):
        for fmt in order[round_ % len(order) :] + order[: round_ % len(order)]:
            c = cached[fmt]
            start = time.perf_counter()
            for _ in range(FORWARDS):
                c.forward(prompt_ids + extra, logits_to_keep=rows)
                c.rollback(len(prompt_ids))
            if round_:
                times[fmt].append((time.perf_counter() - start) / FORWARDS)
    return times


def choose(
    agreement: dict[str, float], times: dict[str, list[float]], lossless: dict[str, bool] | None = None
) -> tuple[str, bool]:
    """(the fastest format with agreement ≥ AGREEMENT_FLOOR that is lossless here, fp32 if none is
    faster; whether the timings were steady). A noisy comparison decides nothing: fp32. A format
    whose products no row plan makes row-invariant on this machine (mtp_viz.row_plan) is not
    chosen: its lossless strategies would part from autoregressive decoding."""
    steady = all(spread(t) <= MAX_SPREAD for t in times.values())
    if not steady:
        return FP32, False
    here = lossless or {}
    eligible = [f for f in times if f == FP32 or (agreement.get(f, 0.0) >= AGREEMENT_FLOOR and here.get(f, True))]
    return min(eligible, key=lambda f: statistics.median(times[f])), True


def record_path(name: str, model: torch.nn.Module) -> Path:
    """Keyed by the machine and the model: its name and a fingerprint of its config and weight sizes."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    shapes = sorted((n, tuple(p.shape)) for n, p in model.named_parameters())
    config = model.config.to_json_string() if hasattr(model, "config") else ""
    return measured.record_path("weights", safe, measured.fingerprint(f"{config}{shapes}"), prefix="auto-")


def read_record(path: Path) -> dict | None:
    return measured.read(path, RECORD_VERSION, check=lambda r: r.get("chosen") in FORMATS)


def describe_record(record: dict) -> str:
    """ "q4 (agreement with fp32 99.6%, one-token forward 14.2 ms vs fp32's 31.0 ms; measured … under load 0.9)" """
    chosen = record["chosen"]
    ms = {f: r["forward_ms"] for f, r in record["formats"].items()}
    load = record.get("load_average")
    busy = f"load {load[0]:.1f}" if load else "load unknown"
    steady = "" if record["settled"] else "; timings too noisy, fp32 until measured again"
    agreement = record["formats"][chosen].get("agreement", 1.0)
    others = ", ".join(
        f"{f} {ms[f]:.1f} ms at {r['agreement']:.1%}{'' if r['lossless'] else ' (not lossless here)'}"
        for f, r in record["formats"].items()
        if f not in (chosen, FP32)
    )
    return (
        f"{chosen} (agreement with fp32 {agreement:.1%}, one-token forward {ms[chosen]:.1f} ms vs fp32's "
        f"{ms[FP32]:.1f} ms; {others}; floor {record['floor']:.0%}; measured {record['measured_at']}, {busy}{steady})"
    )


def measure(loaded: dict[str, Loaded]) -> dict:
    """Every format's agreement, NLL and one-token forward time (`loaded`: the model in each of
    FORMATS), and the choice (the record)."""
    started, load_avg = time.time(), measured.load_average()
    prompts = held_out_prompts()
    scores = quality(loaded[FP32], {f: m for f, m in loaded.items() if f != FP32}, prompts)
    ids = encode(loaded[FP32], prompts[0])
    models = {f: m.model for f, m in loaded.items()}
    times = forward_times(models, ids)
    for _ in range(RETRIES):
        if all(spread(t) <= MAX_SPREAD for t in times.values()):
            break
        times = forward_times(models, ids)
    why_not = {f: not_lossless(m) for f, m in models.items()}  # the row plans measured on load
    chosen, settled = choose(
        {f: s["agreement"] for f, s in scores.items()}, times, {f: not w for f, w in why_not.items()}
    )
    formats = {
        f: {
            **scores.get(f, {}),
            "forward_ms": round(statistics.median(times[f]) * 1e3, 3),
            "spread": spread(times[f]),
            "lossless": not why_not[f],
            "rows": describe_rows(models[f]),
        }
        for f in FORMATS
    }
    return {
        "version": RECORD_VERSION,
        "chosen": chosen,
        "settled": settled,
        "formats": formats,
        "floor": AGREEMENT_FLOOR,
        "prompts": len(prompts),
        "new_tokens": NEW_TOKENS,
        "measured_at": measured.stamp(started),
        "load_average": load_avg,
        "machine": machine_info("cpu"),
        "seconds": round(time.time() - started, 1),
    }


def cached_record(name: str, model: torch.nn.Module) -> dict | None:
    """The choice measured for model `name` (its fp32 `model`) on this machine, unless stale."""
    record = read_record(record_path(name, model))
    return record if record is not None and measured.still_good(record, time.time()) else None


def save_record(name: str, model: torch.nn.Module, record: dict) -> None:
    """Cache a measured choice (whole or absent for a reader); a cache that cannot be written only
    means measuring again next time."""
    measured.write(record_path(name, model), record, what="the weight format choice")
