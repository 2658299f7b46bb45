"""EAGLE-3's ablations at an equal budget (issue 41 §2), each scored on the same validation.

    nice .venv/bin/python experiments/eagle_ablations.py --store ~/.cache/mtp-viz/features/smollm2-135m \\
        --steps 100 | tee docs/results/eagle3-ablations.log

Every variant trains from the same feature store (the corpus's full store: 100 steps of 4,096 chain
positions are a seeded draw of ~0.4M of its 1.7M trained answer positions, the same batches for
every variant; a `train features --sequences N` store does as well where the full one is not built)
for the same optimizer steps, seed and schedule (wsd: it decays at the end, so the last validation
is the variant's best guess at its asymptote rather than a point on a plateau), changing one thing
against `base` (vLLM's default layers 2/15/27, cross entropy only, the head learning from the start,
the draft vocabulary from every token, the training-time test unrolled 3 steps as the corpus run
does: 5 cost 1.7x a step, 16 s against 9.5 s on 2 cores). The runs go to `--runs` (default the
cache's runs/ablations) and a finished one is not run again, so the script resumes: a stopped one
goes on from its last checkpoint (`--resume`); a table of the last validation of each (the
corpus's validation side and the Spec-Bench held-out answers, per draft step, and the tokens a
chain of the steps it unrolled yields per target forward: 3, and 5 for `ttt_5`, whose figure there
is not comparable) ends the log.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from mtp_viz.paths import REPO, cache_root

SHIPPED = REPO / "assets" / "eagle3" / "smollm2-135m-eagle3"
BASE = ["--no-norm-before-fc", "--vocab-from", "all"]  # the recipe the ablations changed (its defaults since)
VARIANTS = {
    "base": [],
    "norm_before_fc": ["--norm-before-fc"],
    "aux_2_15_29": ["--aux-layers", "2,15,29"],
    "regression": ["--regression", "0.5"],
    "frozen_head": ["--frozen-head-steps", "30"],
    "vocab_answers": ["--vocab-from", "answers"],
    "from_shipped": ["--start-from", str(SHIPPED)],  # the drafter we ship, trained further on the corpus
    "ttt_5": ["--ttt-steps", "5"],  # the training-time test unrolled 5 steps instead of the recipe's 3
    # the shipped drafter given norm_before_fc's norm (scaled to its features' median) and trained on
    "from_shipped_norm": ["--start-from", str(SHIPPED), "--norm-before-fc"],
}
COLUMNS = (
    "val_top1_step1",
    "val_top1_step2",
    "val_top1_step3",
    "heldout_top1_step1",
    "heldout_top1_step2",
    "heldout_top1_step3",
    "val_mean_accepted_tokens",
)


def finished(out: Path, steps: int) -> dict | None:
    path = out / "training.json"
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    return report if report.get("step") == steps and report["history"] else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", type=Path, required=True, help="a feature store (train features --sequences N)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--ttt-steps", type=int, default=3, help="draft steps unrolled (the corpus run's 3)")
    parser.add_argument("--model", help="the target (default: the embedded model)")
    parser.add_argument("--runs", type=Path, default=cache_root() / "runs" / "ablations")
    parser.add_argument("--only", nargs="*", choices=sorted(VARIANTS), help="these variants (default: all)")
    args = parser.parse_args()
    names = args.only or list(VARIANTS)
    rows = {}
    for name in names:
        out = args.runs / name
        report = finished(out, args.steps)
        if report is None:
            started = time.perf_counter()
            command = [sys.executable, "-m", "mtp_viz", "train", "eagle", "--data", str(args.store), "--out", str(out)]
            command += ["--steps", str(args.steps), "--epochs", "50", "--schedule", "wsd", "--resume"]
            command += ["--ttt-steps", str(args.ttt_steps), *BASE, *VARIANTS[name]]  # a variant's own flags win
            command += ["--model", args.model] if args.model else []
            print(f"== {name}: {' '.join(command[3:])}", flush=True)
            subprocess.run(command, check=True, cwd=REPO)
            print(f"== {name}: {time.perf_counter() - started:.0f} s", flush=True)
            report = finished(out, args.steps)
        rows[name] = report
    print(f"\n{args.steps} steps each from {args.store} ({rows[names[0]]['train_tokens']} training tokens)\n")
    print("| variant | " + " | ".join(COLUMNS) + " | heldout vocab coverage |")
    print("|---" * (len(COLUMNS) + 2) + "|")
    for name, report in rows.items():
        last = report["history"][-1]
        cells = [f"{last[c]:.3f}" if c in last else "" for c in COLUMNS]
        coverage = report.get("heldout_vocab_coverage")
        print(f"| {name} | " + " | ".join(cells) + (f" | {coverage:.3f} |" if coverage is not None else " | |"))


if __name__ == "__main__":
    main()
