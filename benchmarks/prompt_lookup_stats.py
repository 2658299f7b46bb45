"""What an n-gram match of each size is worth, and what a verify forward costs, on this machine.

    .venv/bin/python benchmarks/prompt_lookup_stats.py

Runs greedy prompt lookup matching every n-gram size from 4 down to 1 on the engine benchmark's
prompts, then reports, per matched size, how many drafted tokens the target kept on average, and
the median target-forward time of steps that fed one token vs steps that fed a draft.
"""

import collections
import statistics

from engine import PROMPTS

from mtp_viz.models import quiet_transformers
from mtp_viz.runner import RunRequest, run
from mtp_viz.strategies.base import GenerationSettings


def main() -> None:
    quiet_transformers()
    kept = collections.defaultdict(list)
    one, many = [], []
    for prompt in PROMPTS.values():
        trace = run(
            RunRequest(
                prompt=prompt,
                strategy="prompt_lookup",
                generation=GenerationSettings(max_new_tokens=128),
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
