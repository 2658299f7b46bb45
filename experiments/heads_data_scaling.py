"""Would more data close the heads' gap? Trains fresh MTP heads (the shipped architecture and
reduced vocabulary, `mtp_viz.training.heads`' losses) on a quarter, a half and all of the cached
training sequences (`python -m mtp_viz train data`), the same number of steps each, and reports
depth-1 top-1 agreement with the target, teacher-forced, on the training run's validation split
and on the target's greedy answers to Spec-Bench prompts (as `heads_variants.py`):

    .venv/bin/python experiments/heads_data_scaling.py [--steps 400] [--fractions 0.25,0.5,1]
        [--data DIR] [--per-category 3]

The slope over doublings of the data is what a larger data set could be expected to buy. As in
`heads_variants.py`, agreement counts only positions whose token is in the reduced vocabulary.
`--steps 400 --fractions 0.125,0.25,0.5,1` on the stage-2 cache (2,090 sequences) produced the
"More data?" table of docs/training.md (2026-12-03); log in
docs/results/heads-variants/data-scaling.log.
"""

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from mtp_viz.drafters.heads import HeadsSpec, build_heads, trained_parameters
from mtp_viz.loading import load_heads_for, load_model, quiet_transformers
from mtp_viz.training.data import load_sequences
from mtp_viz.training.heads import HeadsTrainConfig, losses, positions
from mtp_viz.training.loop import LoopConfig, seed_everything, train

sys.path.insert(0, str(Path(__file__).resolve().parent))
from heads_variants import (  # noqa: E402
    MODEL,
    SPEC_BENCH_PER_CATEGORY,
    agreement,
    data_folder,
    shipped_forward,
    spec_bench_answers,
)


def train_fresh(target, spec: HeadsSpec, vocab: torch.Tensor, seqs, steps: int, cfg: HeadsTrainConfig):
    """Fresh heads trained `steps` batches by the package's own loop (checkpoints in a temp folder)."""
    seed_everything(0)
    heads = build_heads(target.model, spec, vocab).train()
    data = positions(seqs, heads.head.index.cpu(), cfg.depth)
    n, size = len(data.record), cfg.positions_per_batch
    g = torch.Generator().manual_seed(0)
    order = torch.cat([torch.randperm(n, generator=g) for _ in range(steps * size // n + 1)])
    batches = list(order[: steps * size].view(steps, size))
    with tempfile.TemporaryDirectory() as runs:
        train(
            trained_parameters(heads),
            lambda epoch: batches,
            lambda rows: losses(heads, data, rows, cfg),
            dict,  # no validation during the run: agreement is measured after it
            Path(runs),
            cfg.loop,
            log=lambda _: None,
        )
    return heads.eval(), n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--fractions", default="0.25,0.5,1")
    p.add_argument("--data", help="`train data` folder (default: <cache>/train/<model>)")
    p.add_argument("--per-category", type=int, default=SPEC_BENCH_PER_CATEGORY, help="Spec-Bench prompts answered")
    args = p.parse_args()
    quiet_transformers()
    target = load_model(MODEL, "cpu", "float32")
    _, shipped = load_heads_for(target)
    spec, vocab = shipped.spec, shipped.head.ids.cpu()
    h, index = spec.hidden_size, shipped.head.index.cpu()
    data = data_folder(args.data, target)
    train = list(load_sequences(data, 20, holdout=False))
    val = list(load_sequences(data, 20, holdout=True))
    bench = spec_bench_answers(target, args.per_category)
    cfg = HeadsTrainConfig(loop=LoopConfig(epochs=1, lr=1e-3, weight_decay=0.01))  # AdamW's default decay
    cfg = replace(cfg, loop=replace(cfg.loop, warmup_steps=min(cfg.loop.warmup_steps, args.steps // 4)))
    perm = torch.randperm(len(train), generator=torch.Generator().manual_seed(0)).tolist()
    print(f"{len(train)} training sequences; {args.steps} steps of {cfg.positions_per_batch} positions each run")
    print(
        "shipped heads: validation {:.3f}, Spec-Bench answers {:.3f}".format(
            *(agreement(lambda f, t: shipped_forward(shipped, f, t), shipped.head, s, index, h) for s in (val, bench))
        )
    )
    for fraction in (float(f) for f in args.fractions.split(",")):
        subset = [train[i] for i in perm[: round(fraction * len(train))]]
        started = time.perf_counter()
        heads, n = train_fresh(target, spec, vocab, subset, args.steps, cfg)
        fn = lambda f, t, heads=heads: shipped_forward(heads, f, t)  # noqa: E731
        print(
            f"fraction {fraction:g}: {len(subset)} sequences, {n} positions, {time.perf_counter() - started:.0f} s: "
            f"validation {agreement(fn, heads.head, val, index, h):.3f}, "
            f"Spec-Bench answers {agreement(fn, heads.head, bench, index, h):.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
