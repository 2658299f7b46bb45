"""Moved to mtp_viz.loading; importers move there too."""

from mtp_viz.loading import *  # noqa: F403
from mtp_viz.loading import __all__  # noqa: F401
from mtp_viz.loading.sources import convert_gguf, save_atomically  # noqa: F401
from mtp_viz.paths import cache_root  # noqa: F401
