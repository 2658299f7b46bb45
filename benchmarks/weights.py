"""Weight formats side by side: quality against fp32 and speed in the engine, in one run.

    python benchmarks/weights.py [--model smollm2-135m] [--prompts 13] [--new-tokens 64] [--rounds 5] [--out F]

Quality (held-out Spec-Bench prompts, the first question of each category): fp32 writes a greedy
continuation; each format reads it teacher-forced; agreement = the share of positions where the
format's greedy token is fp32's, NLL = mean negative log-likelihood of fp32's tokens under the
format (mtp_viz.weights_auto.quality, what `--weights auto` decides by).
Speed, interleaved so that machine noise hits every format alike: the median time of a 1-token and
a 4-token forward (head included) after a prompt, and autoregressive tokens/s through the runner
(formats round-robin per prompt and round; the best of the rounds, as benchmarks/engine.py does).
Weight bytes: what one forward streams through the linear layers and the head; with the machine's
read bandwidth (the best of a sum and of the head's two-row product over 1 GiB) they give the
stream floor of a one-token forward, and the forward's ratio to it.

Its tables are in docs/BENCHMARKS.md ("Weight formats"), its logs in docs/results/weights-bench*.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from mtp_viz.loading import load_model, quiet_transformers
from mtp_viz.machine import describe
from mtp_viz.runner import RECORD_MINIMAL, RunRequest, run
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.weights import FORMATS, FP32, FormatLinear
from mtp_viz.weights_auto import encode, forward_times, held_out_prompts, quality


def linear_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights one forward streams: every linear's in its kernel's form (q4: the
    packed codes and bfloat16 scales, not the unpacked codes the module also keeps) and the head."""
    total = 0
    for module in model.modules():
        if isinstance(module, FormatLinear):
            total += module.streamed_bytes()
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total


def read_bandwidth(gib: float = 1.0, rounds: int = 5) -> tuple[float, dict[str, float]]:
    """This machine's read bandwidth (bytes/s), the best of two ways of streaming `gib` GiB of
    float32 once: a sum, and the weight-on-the-left product of two rows (what the fp32 head runs).
    Returns the best and each way's best."""
    n = int(gib * 2**30 / 4) // 576 * 576
    flat = torch.randn(n)
    matrix = flat.view(-1, 576)
    rows = torch.randn(2, 576)
    ways = {"sum": lambda: flat.sum(), "mm 2 rows": lambda: torch.mm(matrix, rows.t())}
    best = {}
    for name, way in ways.items():
        way()
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            way()
            times.append(time.perf_counter() - start)
        best[name] = n * 4 / min(times)
    return max(best.values()), best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--prompts", type=int, default=13, help="held-out prompts (one per Spec-Bench category)")
    parser.add_argument("--new-tokens", type=int, default=64, help="fp32's continuation scored (quality)")
    parser.add_argument("--ar-prompts", type=int, default=3, help="prompts of the tokens/s comparison")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per autoregressive run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bandwidth-gib", type=float, default=1.0, help="GiB read to measure the bandwidth")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    quiet_transformers()
    formats = [f for f in args.formats.split(",") if f]
    if FP32 not in formats:
        formats.insert(0, FP32)
    bandwidth, ways = read_bandwidth(args.bandwidth_gib)  # first: a failure here costs nothing else
    loaded = {f: load_model(args.model, "cpu", "float32", f) for f in formats}
    load = [round(x, 2) for x in os.getloadavg()]
    prompts = held_out_prompts(args.prompts)

    scores = quality(loaded[FP32], {f: m for f, m in loaded.items() if f != FP32}, prompts, args.new_tokens)
    ids = encode(loaded[FP32], prompts[0])
    models = {f: m.model for f, m in loaded.items()}
    one = forward_times(models, ids, rows=1, rounds=args.rounds)
    four = forward_times(models, ids, rows=4, rounds=args.rounds)

    tokens_per_s: dict[str, list[float]] = {f: [] for f in formats}
    machines = {}
    generation = GenerationSettings(max_new_tokens=args.max_new_tokens)
    for prompt in prompts[: args.ar_prompts]:
        best = {f: 0.0 for f in formats}
        for round_ in range(args.rounds):
            for f in formats[round_ % len(formats) :] + formats[: round_ % len(formats)]:
                trace = run(
                    RunRequest(prompt=prompt, model=args.model, weights=f, generation=generation, record=RECORD_MINIMAL)
                )
                best[f] = max(best[f], trace.summary["tokens_per_s"])
                machines[f] = describe(trace.machine)
        for f in formats:
            tokens_per_s[f].append(best[f])

    print(f"model {args.model}; {len(prompts)} held-out prompts × {args.new_tokens} fp32 tokens (quality)")
    print(f"load average at the start {load} on {os.cpu_count()} cores; after {[round(x, 2) for x in os.getloadavg()]}")
    print(f"machine: {machines.get(FP32, '?')}")
    each = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in ways.items())
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s (best of: {each})")
    header = "| format | agreement with fp32 | NLL of fp32's tokens | weight MB / forward | 1-token forward ms |"
    header += " 4-token forward ms | 4 / 1 | stream floor ms | 1-token / floor | AR tokens/s | AR vs fp32 |"
    print(header)
    print("|" + "---|" * 11)
    rows = {}
    fp32_tps = statistics.mean(tokens_per_s[FP32])
    for f in formats:
        s = scores.get(f, {"agreement": 1.0, "nll": None})
        ms1, ms4 = statistics.median(one[f]) * 1e3, statistics.median(four[f]) * 1e3
        tps = statistics.mean(tokens_per_s[f])
        streamed = linear_bytes(models[f])
        mb, floor = streamed / 2**20, streamed / bandwidth * 1e3
        nll = "—" if s["nll"] is None else f"{s['nll']:.4f}"
        print(
            f"| {f} | {s['agreement']:.2%} | {nll} | {mb:.0f} | {ms1:.1f} | {ms4:.1f} | {ms4 / ms1:.2f} | "
            f"{floor:.1f} | {ms1 / floor:.2f}x | {tps:.1f} | {tps / fp32_tps:.2f}x |"
        )
        rows[f] = {**s, "weight_mb": mb, "floor_ms": floor, "forward_1_s": one[f], "forward_4_s": four[f]}
        rows[f]["tokens_per_s"] = tokens_per_s[f]
    for f in formats:
        print(f"  {f}: {machines[f]}")
    if args.out:
        record = {"model": args.model, "load_average": load, "machines": machines, "formats": rows}
        record["read_bandwidth"] = {"best": bandwidth, **ways}
        args.out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
