"""`python -m mtp_viz`: the command line (mtp_viz/cli, a module per command)."""

import sys

from mtp_viz.cli import main

if __name__ == "__main__":
    sys.exit(main())
