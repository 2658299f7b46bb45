"""The drafters we ship retrained on the corpus (issue 41 §3): the MTP heads, the draft model and
the mask-token adapter, each trained further from its shipped weights on one feature store, and
judged before and after on the same held-out Spec-Bench answers (mtp_viz.training.heldout, which
every trainer scores at every validation):

    nice .venv/bin/python -m mtp_viz train features        # the corpus's store (~3 h on 2 cores)
    nice .venv/bin/python experiments/retrain_drafters.py --store ~/.cache/mtp-viz/features/smollm2-135m \\
        --heads-steps 1200 --draft-steps 300 --mtp-steps 200 | tee docs/results/retrained-drafters.log

(a smaller store, `train features --sequences N --out DIR`, does as well for a quicker look). The
budgets matter on 2 cores: one epoch of the corpus's store (1.71 M answer positions) is ~3,350
steps of the heads' trainer at ~1.3 s each (1.2 h); each cosine schedule decays within its budget.

Each run keeps the shipped drafter's own settings (read from its training.json: the heads' depth,
the draft's layers, the adapter's k_max, rank and gating) and the trainer's defaults otherwise;
its weights go to `--runs` (default the cache's runs/retrained/<kind>), and a finished run is not
run again, so the script resumes. The table ends the log: the held-out scores of the shipped
weights (the first validation) and of the retrained ones (the last), and which is better by the
figure a decode pays on (tokens per target forward; the draft's top-1 agreement). Shipping the
better one is a copy into assets/ and a commit, left to whoever reads the table.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from mtp_viz.paths import ASSETS, cache_root

# kind → (the shipped weights, the settings carried over from their training.json, the figure that decides)
KINDS = {
    "heads": (ASSETS / "heads" / "smollm2-135m-mtp", {"depth": "--depth"}, "heldout_mean_accepted_tokens"),
    "draft": (ASSETS / "drafts" / "smollm2-135m-draft", {"layers": "--layers"}, "heldout_agreement"),
    "mtp": (
        ASSETS / "mtp" / "smollm2-135m-mask",
        {"k_max": "--k-max", "rank": "--rank", "gating": "--gating"},
        "heldout_tokens_per_forward",
    ),
}


def finished(out: Path) -> dict | None:
    """The report of a run that ended (its weights saved last), else None."""
    path = out / "training.json"
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    return report if "seconds" in report and report.get("history") else None


def command(kind: str, store: Path, out: Path, start: Path | None, model: str | None, steps: int | None) -> list[str]:
    """`train <kind>` from `store` into `out`, from `start` with its own settings (None: afresh)."""
    shipped, carried, _ = KINDS[kind]
    args = [sys.executable, "-m", "mtp_viz", "train", kind, "--data", str(store), "--out", str(out)]
    if start is not None:
        config = json.loads((start / "training.json").read_text())["config"]
        args += ["--start-from", str(start)]
        args += [a for key, flag in carried.items() for a in (flag, str(config[key]))]
    args += ["--steps", str(steps)] if steps else []
    return args + (["--model", model] if model else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", type=Path, required=True, help="a feature store (train features --sequences N)")
    parser.add_argument("--model", help="the target (default: the embedded model)")
    parser.add_argument("--runs", type=Path, default=cache_root() / "runs" / "retrained")
    parser.add_argument("--only", nargs="*", choices=sorted(KINDS), help="these drafters (default: all)")
    parser.add_argument("--fresh", action="store_true", help="train each from scratch, not from the shipped weights")
    for kind in KINDS:  # a store's epoch is long on 2 cores: a budget each (cosine decays within it)
        parser.add_argument(f"--{kind}-steps", type=int, help=f"{kind}: at most this many optimizer steps")
    args = parser.parse_args()
    rows = {}
    for kind in args.only or list(KINDS):
        out = args.runs / kind
        report = finished(out)
        if report is None:
            start = None if args.fresh else KINDS[kind][0]
            cmd = command(kind, args.store, out, start, args.model, getattr(args, f"{kind}_steps"))
            print(f"== {kind}: {' '.join(cmd[3:])}", flush=True)
            began = time.perf_counter()
            subprocess.run(cmd, check=True)
            print(f"== {kind}: {time.perf_counter() - began:.0f} s", flush=True)
            report = finished(out)
        rows[kind] = report
    print(f"\nheld-out Spec-Bench answers, before (the {'untrained' if args.fresh else 'shipped'} weights) and after\n")
    print("| drafter | figure | before | after | better |")
    print("|---|---|---|---|---|")
    for kind, report in rows.items():
        decides = KINDS[kind][2]
        before, after = report["before"], report["history"][-1]
        for key in sorted(k for k in after if k.startswith("heldout_")):
            better = ("after" if after[key] > before[key] else "before") if key == decides else ""
            print(f"| {kind} | {key.removeprefix('heldout_')} | {before[key]:.3f} | {after[key]:.3f} | {better} |")


if __name__ == "__main__":
    main()
