"""What the row plans (mtp_viz.row_plan) cost a whole forward, per weight format: the prompt's
prefill and a 1-, 4- and 32-row verify after it, under the plans measured on this machine against
every product called as it comes (not exact where a plan was needed), in interleaved rounds.

    python benchmarks/row_plans.py [--model smollm2-135m] [--weights fp32 bf16 int8 q4] [--rounds 5]

Log in docs/results/row-plans-cost-epyc.log; figures in docs/BENCHMARKS.md, "Lossless on the same weights".
"""

import argparse
import statistics
import time

import torch

from mtp_viz.cache import CachedModel
from mtp_viz.kernels import RAW_ROWS
from mtp_viz.loading import load_model
from mtp_viz.row_plan import applied, use_row_plans
from mtp_viz.weights import FORMATS

PROMPT = list(range(100, 140))  # 40 tokens
ROWS = (1, 4, 32)


@torch.inference_mode()
def timings(model: torch.nn.Module, plans: dict, rounds: int) -> dict[str, dict]:
    """Median ms per (way, what): way "planned" or "as is", what "prefill" or a row count."""
    ways = {"planned": plans, "as is": dict.fromkeys(plans, RAW_ROWS)}
    times: dict[tuple[str, object], list[float]] = {}
    for round_ in range(rounds + 1):
        for way in list(ways)[round_ % 2 :] + list(ways)[: round_ % 2]:
            use_row_plans(model, ways[way])
            cached = CachedModel(model, prompt_length=len(PROMPT))
            start = time.perf_counter()
            cached.forward(PROMPT)
            spans = {"prefill": time.perf_counter() - start}
            for rows in ROWS:
                start = time.perf_counter()
                cached.forward(PROMPT + PROMPT[:rows], logits_to_keep=rows)
                spans[rows] = time.perf_counter() - start
                cached.rollback(len(PROMPT))
            if round_:  # round 0 warms up
                for what, s in spans.items():
                    times.setdefault((way, what), []).append(s)
    use_row_plans(model, plans)
    return {way: {what: statistics.median(times[way, what]) * 1e3 for what in ("prefill", *ROWS)} for way in ways}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--weights", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for fmt in args.weights:
        model = load_model(args.model, "cpu", "float32", weights=fmt).model
        plans = applied(model)
        ms = timings(model, plans, args.rounds)
        print(f"{fmt}: " + "; ".join(f"{f} {p.describe()}" for f, p in plans.items()))
        for what in ("prefill", *ROWS):
            label = "prefill (39 rows)" if what == "prefill" else f"{what}-row verify"
            planned, raw = ms["planned"][what], ms["as is"][what]
            print(f"  {label:<18} as is {raw:7.1f} ms  planned {planned:7.1f} ms  ({planned / raw:.2f}x)")


if __name__ == "__main__":
    main()
