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


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "mtp-viz"))
