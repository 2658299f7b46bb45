"""Where a tree-verification step's time goes on this machine, against a one-token forward.

    .venv/bin/python experiments/verify_split.py [--context 300] [--repeats 30] [--model smollm2-135m]

Times, interleaved round-robin so drift hits every variant alike: a plain one-token forward (what
autoregressive decoding pays), forward_hidden with 0..4 extra tokens as a chain and as the
default tree, and the greedy accept rule on the result. Medians in ms, and ratios to the plain
forward.

Produced the figures in docs/BENCHMARKS.md, "Verify-cost curve, draft cost ratio and early-exit
agreement on this CPU (issue 6)": 300 cached tokens, tree `0,1,00` forward 1.20x, the accept
rule 0.005x (2026-12-03 16:19 UTC)."""

import argparse
import statistics
import time

import torch

from mtp_viz.cache import CachedModel
from mtp_viz.clock import Clock
from mtp_viz.loading import load_model
from mtp_viz.strategies.base import DecodeContext, GenerationSettings, verify_tree
from mtp_viz.visibility import node_depths, tree_visibility


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--model", default="smollm2-135m")
    args = p.parse_args()
    torch.manual_seed(0)
    target = load_model(args.model, "cpu", "float32")
    vocab = target.model.config.vocab_size
    seq = torch.randint(0, vocab, (args.context,)).tolist()
    cached = CachedModel(target.model, vocab)
    with torch.inference_mode():
        cached.forward(seq[:-1])
    base = len(seq) - 1
    shapes = {"chain-1": [-1], "chain-2": [-1, 0], "tree 0,1,00": [-1, -1, 0], "chain-4": [-1, 0, 1, 2]}
    ctx = DecodeContext(  # greedy, full recording: what verify_tree reads
        target=target.model,
        prompt_ids=seq,
        generation=GenerationSettings(),
        eos_token_ids=frozenset(),
        vocab_size=vocab,
        clock=Clock(),
    )

    def forward(feed):
        """A timed variant: one forward from the fixed cache, then back to it."""

        def run():
            with torch.inference_mode():
                feed()
            cached.rollback(base)

        return run

    def tree(parents):
        return lambda: cached.forward_hidden(seq, [5] * len(parents), node_depths(parents), tree_visibility(parents))

    def accept(parents):
        with torch.inference_mode():
            logits, _ = tree(parents)()
        cached.rollback(base)

        def run():
            with torch.inference_mode():
                verify_tree(ctx, logits, [5] * len(parents), parents)

        return run

    variants = {
        "plain forward": forward(lambda: cached.forward(seq)),
        "forward_hidden, no extra": forward(lambda: cached.forward_hidden(seq)),
    }
    variants |= {
        f"plain causal forward, {k} tokens": forward(lambda k=k: cached.forward(seq + [5] * (k - 1), logits_to_keep=k))
        for k in (2, 3, 4, 5)
    }
    variants |= {f"forward_hidden, {k}": forward(tree(v)) for k, v in shapes.items()}
    variants |= {f"accept rule, {k}": accept(v) for k, v in shapes.items()}
    times = {k: [] for k in variants}
    for fn in variants.values():
        fn()
    for _ in range(args.repeats):
        for name, fn in variants.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    ref = statistics.median(times["plain forward"])
    print(f"context {args.context}, {args.repeats} repeats, medians")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:34s} {m * 1e3:7.2f} ms  {m / ref:5.2f}x")


if __name__ == "__main__":
    main()
