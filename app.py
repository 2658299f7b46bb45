"""Browser entry point: `python app.py` serves mtp-viz on http://127.0.0.1:7860. On a CPU, a model's
compiled engine is built in the background once per machine while the eager one serves
(mtp_viz.compiled_choice)."""

from mtp_viz import compiled_choice
from mtp_viz.loading import quiet_transformers
from mtp_viz.ui.app import build_app

if __name__ == "__main__":
    quiet_transformers()
    compiled_choice.allow_builds(compiled_choice.BACKGROUND)
    build_app().queue().launch()
