"""Where things live on disk: the repository's shipped files, and the cache this machine fills
(converted models, measured kernel plans, training data, profiles, exports). The lowest layer:
it imports nothing of mtp_viz, so every module may ask it."""

import os
from pathlib import Path

CACHE_ENV = "MTP_VIZ_CACHE"  # overrides the cache folder (default ~/.cache/mtp-viz)
PACKAGE = Path(__file__).resolve().parent
REPO = PACKAGE.parent
ASSETS = REPO / "assets"  # example traces, bench results and serving sweeps the app ships
PROFILES = REPO / "docs" / "results"  # shipped profiles (profile-*.json), with the docs' other measurements


BUILD_ENV = "MTP_VIZ_BUILD_CACHE"  # overrides where built code goes (default: the cache folder's build/)


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "mtp-viz"))


def build_root() -> Path:
    """Where code built for this machine is kept (mtp_viz.native's kernels, mtp_viz.static's compiled
    layers): a pure function of the sources, torch and the machine, apart from the measurements."""
    return Path(os.environ.get(BUILD_ENV) or cache_root() / "build")
