"""Two EAGLE-3 drafters side by side on Spec-Bench answers (training-style agreement: teacher-forced,
answer positions, a token outside a drafter's vocabulary a miss; a chain of 3):

    .venv/bin/python experiments/eagle3_compare.py OTHER_DRAFTER_DIR [--fresh]

Without --fresh: the fixed held-out set (the target's 96-token answers to prompts 1-3 of each
category, the set every trainer validates on and which chose the shipped drafter), per category.
With --fresh: prompts 4-6 of each category instead (answered once and cached; nothing was chosen on
them), overall. The first column is the shipped drafter (the registry's first), the second OTHER.
"""

import sys

import torch

from mtp_viz.loading import load_eagle3_for, load_model
from mtp_viz.prompts import spec_bench
from mtp_viz.training.eagle import EagleTrainConfig, agreement, sequence_examples
from mtp_viz.training.heldout import spec_bench_heldout


def scores(target, drafter, seqs) -> dict[str, float]:
    cfg = EagleTrainConfig()
    with torch.no_grad():
        exs = sequence_examples(target.model, seqs, drafter.config.aux_layer_ids, drafter.to_draft_index(), cfg)
        return agreement(drafter, exs, 3)


def main() -> None:
    other, fresh = sys.argv[1], "--fresh" in sys.argv[2:]
    target = load_model("smollm2-135m", "cpu", "float32")
    drafters = {"shipped": load_eagle3_for(target)[1], other: load_eagle3_for(target, other)[1]}
    cats = list(dict.fromkeys(q["category"] for q in spec_bench()))
    if fresh:
        seqs = spec_bench_heldout(target, per_category=6)
        seqs = [s for i in range(len(cats)) for s in seqs[6 * i + 3 : 6 * i + 6]]
        for name, drafter in drafters.items():
            print(name, {k: round(v, 3) for k, v in scores(target, drafter, seqs).items()}, flush=True)
        return
    seqs = spec_bench_heldout(target)
    print("category | " + " | ".join(drafters) + "  (top-1 at steps 1/2/3)")
    for i, category in enumerate(cats):
        cells = [scores(target, d, seqs[3 * i : 3 * i + 3]) for d in drafters.values()]
        steps = ["/".join(f"{c[f'val_top1_step{j}']:.2f}" for j in (1, 2, 3)) for c in cells]
        print(f"{category} | " + " | ".join(steps))


if __name__ == "__main__":
    main()
