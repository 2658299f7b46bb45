"""Command line: `python -m mtp_viz run|check-distribution ...`."""

import argparse
import logging
import os
import sys

from mtp_viz.cli import bench, export, profile, run, train, tune
from mtp_viz.errors import UserError
from mtp_viz.loading import quiet_transformers

DEBUG_ENV = "MTP_VIZ_DEBUG"
COMMANDS = (run, bench, profile, tune, train, export)  # each adds its commands, in the order --help lists them


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    top = _Parser(prog="python -m mtp_viz", description=__doc__)
    sub = top.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in COMMANDS:
        command.add(sub)
    return top


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    quiet_transformers()
    args = parser().parse_args(argv)
    try:
        args.func(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        return 2
    except Exception as e:  # a bug, not bad input: one line, the traceback on request
        if os.environ.get(DEBUG_ENV):
            raise
        print(f"internal error: {type(e).__name__}: {e} (set {DEBUG_ENV}=1 for the traceback)", file=sys.stderr)
        return 1
    return 0
