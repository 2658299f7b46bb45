"""The shipped draft model and another side by side on Spec-Bench answers (its trainer's agreement:
teacher-forced top-1 against the target's greedy choice at answer positions):

    .venv/bin/python experiments/draft_compare.py OTHER_DRAFT_DIR

on the fixed held-out set (the target's 96-token answers to prompts 1-3 of each category, which
every trainer validates on and which chose the shipped draft) and on prompts 4-6 of each category
(answered once and cached; nothing was chosen on them).
"""

import sys
from pathlib import Path

import torch

from mtp_viz.drafters.draft import load_draft
from mtp_viz.loading import load_model
from mtp_viz.prompts import spec_bench
from mtp_viz.training.draft import DraftTrainConfig, agreement, scored_batches
from mtp_viz.training.heldout import spec_bench_heldout


def main() -> None:
    target = load_model("smollm2-135m", "cpu", "float32")
    cats = list(dict.fromkeys(q["category"] for q in spec_bench()))
    seqs = spec_bench_heldout(target, per_category=6)
    sets = {
        "prompts 1-3": [s for i in range(len(cats)) for s in seqs[6 * i : 6 * i + 3]],
        "prompts 4-6": [s for i in range(len(cats)) for s in seqs[6 * i + 3 : 6 * i + 6]],
    }
    drafts = {
        "shipped": load_model("smollm2-135m-draft").model,
        sys.argv[1]: load_draft(target.model, Path(sys.argv[1])),
    }
    for name, draft in drafts.items():
        index = draft.eval().lm_head.index.cpu()
        for label, answers in sets.items():
            batches = scored_batches(answers, index, DraftTrainConfig().tokens_per_batch)
            with torch.no_grad():
                got = agreement(draft, batches)["val_agreement"]
            print(f"{name} | {label} | {got:.4f}", flush=True)


if __name__ == "__main__":
    main()
