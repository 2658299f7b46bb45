"""Moved to mtp_viz.loading.eagle3; importers move there too."""

from mtp_viz.loading.eagle3 import eagle3_dir, eagle3_entry, load_eagle3_for  # noqa: F401
