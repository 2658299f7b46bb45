"""`export-draft`: a trained draft as a plain model directory another engine (vLLM) loads;
`export-eagle3`: an EAGLE-3 drafter as the checkpoint vLLM's LlamaForCausalLMEagle3 loads."""

import argparse
import json
from pathlib import Path

from mtp_viz.serving.export import export_draft, export_eagle3


def add(sub) -> None:
    p = sub.add_parser(
        "export-draft", help="write a trained draft as a plain model directory another engine (vLLM) loads"
    )
    p.add_argument("--draft", required=True, help="registry id of a trained draft (e.g. smollm2-135m-draft)")
    p.add_argument("--out", type=Path, help="where (default: <cache>/export/<draft>)")
    p.set_defaults(func=cmd_export_draft)
    p = sub.add_parser("export-eagle3", help="write an EAGLE-3 drafter as the checkpoint vLLM's eagle3 method loads")
    p.add_argument(
        "--eagle3", required=True, help="registry id of an EAGLE-3 drafter (e.g. smollm2-135m-eagle3) or its directory"
    )
    p.add_argument("--out", type=Path, required=True, help="the folder to write (replaced if it exists)")
    p.set_defaults(func=cmd_export_eagle3)


def cmd_export_draft(args: argparse.Namespace) -> None:
    print(f"{args.draft} written to {export_draft(args.draft, args.out)} (vLLM: --speculative-config model=<that>)")


def cmd_export_eagle3(args: argparse.Namespace) -> None:
    out = export_eagle3(args.eagle3, args.out)
    spec = json.dumps({"method": "eagle3", "model": str(out), "num_speculative_tokens": 3})
    print(f"{args.eagle3} written to {out} (vLLM: --speculative-config '{spec}')")
