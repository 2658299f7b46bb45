"""Where the time of a `python -m mtp_viz bench` run went, per step and strategy, from its traces:

    .venv/bin/python benchmarks/time_split.py RESULTS_DIR

RESULTS_DIR is the bench run's `--out` (its traces are under RESULTS_DIR/traces/). Draft = time
spent drafting; verify = the target forward (each step's `verify_s`); other = the rest of the wall
time (the accept rule, the trace, bookkeeping between steps). Runs whose engine does not report
step timings (vLLM) are left out. Its table is in docs/BENCHMARKS.md, "Spec-Bench on the embedded
model (issue 6)", "Where the time goes"."""

import sys
from pathlib import Path

from mtp_viz.trace import Trace


def timed(trace: Trace) -> bool:
    return all(s.draft_s is not None and s.verify_s is not None for s in trace.steps)


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    root = Path(sys.argv[1]) / "traces"
    print(f"{'run':42s} {'steps':>6s} {'draft ms':>9s} {'verify ms':>10s} {'other ms':>9s}")
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        traces = [Trace.load(path) for path in sorted(folder.glob("*.json"))]
        if not traces or not all(timed(t) for t in traces):
            print(f"{folder.name:42s} (no step timings recorded)")
            continue
        steps = sum(len(t.steps) for t in traces)
        draft = sum(s.draft_s for t in traces for s in t.steps)
        verify = sum(s.verify_s for t in traces for s in t.steps)
        wall = sum(t.wall_time_s for t in traces)
        per = 1e3 / max(1, steps)
        other = (wall - draft - verify) * per
        print(f"{folder.name:42s} {steps:6d} {draft * per:9.1f} {verify * per:10.1f} {other:9.1f}")


if __name__ == "__main__":
    main()
