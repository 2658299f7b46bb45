"""Where the time of a `python -m mtp_viz bench` run went, per step and strategy, from its traces:

    .venv/bin/python benchmarks/time_split.py RESULTS_DIR

Draft = time spent drafting; verify = the target forward (each step's `verify_s`); other = the
rest of the wall time (the accept rule, the trace, bookkeeping between steps)."""

import sys
from pathlib import Path

from mtp_viz.trace import Trace


def main() -> None:
    root = Path(sys.argv[1]) / "traces"
    print(f"{'run':42s} {'steps':>6s} {'draft ms':>9s} {'verify ms':>10s} {'other ms':>9s}")
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        steps = draft = verify = wall = 0.0
        for path in folder.glob("*.json"):
            trace = Trace.load(path)
            steps += len(trace.steps)
            draft += sum(s.draft_s for s in trace.steps)
            verify += sum(s.verify_s for s in trace.steps)
            wall += trace.wall_time_s
        per = 1e3 / max(1.0, steps)
        other = (wall - draft - verify) * per
        print(f"{folder.name:42s} {steps:6.0f} {draft * per:9.1f} {verify * per:10.1f} {other:9.1f}")


if __name__ == "__main__":
    main()
