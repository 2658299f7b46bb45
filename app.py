"""Browser entry point: `python app.py` serves mtp-viz on http://127.0.0.1:7860."""

from mtp_viz.loading import quiet_transformers
from mtp_viz.ui.app import build_app

if __name__ == "__main__":
    quiet_transformers()
    build_app().queue().launch()
