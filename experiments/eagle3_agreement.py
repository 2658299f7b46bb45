"""Does the EAGLE-3 drafter read further ahead than the MTP heads? Per-step top-1 agreement with
the target, teacher-forced (each step fed the real earlier tokens and the drafter's own earlier
outputs), on the same held-out positions for both:

    .venv/bin/python experiments/eagle3_agreement.py --data ~/.cache/mtp-viz/train/eagle-smollm2

- the validation split of the EAGLE-3 run's data (every 20th cached sequence: same prompt
  families as training, answers never trained on), and
- the target's greedy answers (96 tokens) to the first 3 Spec-Bench prompts of each category
  (as experiments/heads_variants.py; no Spec-Bench prompt is in any training data).

Answer positions only; a target token outside a drafter's reduced vocabulary counts as a miss for
that drafter (both use 8,192 ids, chosen from their own training data). Also printed: the tokens
a greedy chain of 3 drafts would yield per target forward, 1 + Σ_j P(drafts 1..j right).
"""

import argparse
import sys
import time
from pathlib import Path

import torch

from mtp_viz.loading import load_eagle3_for, load_heads_for, load_model, quiet_transformers
from mtp_viz.training import eagle, heads
from mtp_viz.training.data import load_sequences

sys.path.insert(0, str(Path(__file__).resolve().parent))
from heads_variants import MODEL, SPEC_BENCH_PER_CATEGORY, spec_bench_answers  # noqa: E402

STEPS = 3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True, help="the EAGLE-3 run's `train data` folder")
    p.add_argument("--eagle3", help="EAGLE-3 drafter: registry id or folder (default: the model's first)")
    p.add_argument("--per-category", type=int, default=SPEC_BENCH_PER_CATEGORY)
    args = p.parse_args()
    quiet_transformers()
    started = time.perf_counter()
    target = load_model(MODEL, "cpu", "float32")
    eagle_id, drafter = load_eagle3_for(target, args.eagle3)
    heads_id, mtp = load_heads_for(target)
    cfg = eagle.EagleTrainConfig()
    val = list(load_sequences(args.data, cfg.holdout_every, holdout=True))
    bench = spec_bench_answers(target, args.per_category)
    print(f"{eagle_id} vs {heads_id}; {len(val)} validation sequences, {len(bench)} Spec-Bench answers", flush=True)
    for name, seqs in (("validation split", val), ("Spec-Bench answers", bench)):
        with torch.no_grad():
            e = eagle.agreement(
                drafter,
                eagle.sequence_examples(
                    target.model, seqs, drafter.config.aux_layer_ids, drafter.to_draft_index(), cfg
                ),
                STEPS,
            )
            h = heads.agreement(mtp, heads.positions(seqs, mtp.head.index.cpu(), STEPS), STEPS)
        per_step = ", ".join(
            f"step {j}: eagle {e[f'val_top1_step{j}']:.3f} / heads {h[f'val_top1_depth{j}']:.3f}"
            for j in range(1, STEPS + 1)
        )
        print(f"{name}: {per_step}", flush=True)
        print(
            f"{name}: tokens per forward of a greedy chain of {STEPS}: eagle {e['val_mean_accepted_tokens']:.3f} / "
            f"heads {h['val_mean_accepted_tokens']:.3f}",
            flush=True,
        )
    print(f"done in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
