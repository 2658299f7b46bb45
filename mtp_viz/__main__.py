"""`python -m mtp_viz`: the command line (mtp_viz/cli, a module per command). On a CPU, `compile=auto`
builds a model's compiled engine here, once per machine, saying so (mtp_viz.compiled_choice)."""

import sys

from mtp_viz import compiled_choice
from mtp_viz.cli import main

if __name__ == "__main__":
    compiled_choice.allow_builds(compiled_choice.FOREGROUND)
    sys.exit(main())
