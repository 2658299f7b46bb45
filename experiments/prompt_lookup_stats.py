"""What an n-gram match of each size is worth, and what a verify forward costs, on this machine.

    .venv/bin/python experiments/prompt_lookup_stats.py [--model smollm2-135m] [--max-new-tokens 128]

Runs greedy prompt lookup matching every n-gram size from 4 down to 1 on the engine benchmark's
prompts (benchmarks/engine.py), then reports, per matched size, how many drafted tokens the target
kept on average, and the median target-forward time of steps that fed one token vs steps that fed
a draft.

Produced the figures in docs/BENCHMARKS.md, "Engine: ours vs transformers `generate` (issue 2)",
on 2026-12-02 with `F.linear` (before `mtp_viz.kernels`): a 1-gram match keeps 0.37 tokens, a
2-gram 0.98, a 3-gram 2.36; one token plus a draft cost 2.0x a one-token forward (174 vs 87 ms).
They are why `prompt_lookup`'s `min_ngram_size` defaults to 2.
"""

import argparse
import collections
import statistics
import sys
from pathlib import Path

from mtp_viz.loading import quiet_transformers
from mtp_viz.runner import RunRequest, run
from mtp_viz.strategies.base import GenerationSettings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from engine import PROMPTS  # noqa: E402  the engine benchmark's five prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    quiet_transformers()
    kept = collections.defaultdict(list)
    one, many = [], []
    for prompt in PROMPTS.values():
        trace = run(
            RunRequest(
                prompt=prompt,
                model=args.model,
                strategy="prompt_lookup",
                generation=GenerationSettings(max_new_tokens=args.max_new_tokens),
                strategy_settings={"max_ngram_size": 4, "min_ngram_size": 1},
            )
        )
        for s in trace.steps[1:]:  # the first step is the prefill
            kept[s.extra["ngram_size"]].append(s.accepted)
            (many if s.drafted else one).append(s.verify_s)
    for n, values in sorted(kept.items()):
        label = "no match" if n == 0 else f"{n}-gram match"
        print(f"{label}: {len(values)} steps, mean drafted tokens kept {statistics.mean(values):.2f}")
    t1, tk = statistics.median(one), statistics.median(many)
    print(f"target forward (median): 1 token {t1 * 1e3:.0f} ms, 1 + draft tokens {tk * 1e3:.0f} ms = {tk / t1:.2f}x")


if __name__ == "__main__":
    main()
