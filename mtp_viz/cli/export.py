"""`export-draft`: a trained draft as a plain model directory another engine (vLLM) loads."""

import argparse
from pathlib import Path

from mtp_viz.serving.export import export_draft


def add(sub) -> None:
    p = sub.add_parser(
        "export-draft", help="write a trained draft as a plain model directory another engine (vLLM) loads"
    )
    p.add_argument("--draft", required=True, help="registry id of a trained draft (e.g. smollm2-135m-draft)")
    p.add_argument("--out", type=Path, help="where (default: <cache>/export/<draft>)")
    p.set_defaults(func=cmd_export_draft)


def cmd_export_draft(args: argparse.Namespace) -> None:
    print(f"{args.draft} written to {export_draft(args.draft, args.out)} (vLLM: --speculative-config model=<that>)")
