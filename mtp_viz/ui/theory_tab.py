"""The Theory tab: Leviathan et al.'s predicted speedup for α, γ, c (sliders), the same with this
device's measured verify-cost curve, and the measured points of the user's own runs."""

import json
from pathlib import Path

import gradio as gr

from mtp_viz.errors import UserError
from mtp_viz.theory import expected_tokens, measured_point, optimal_gamma, speedup
from mtp_viz.ui import notes, service
from mtp_viz.ui.explore import example_traces
from mtp_viz.viz import figures

PROFILES = Path(__file__).resolve().parent.parent.parent / "docs"
MAX_GAMMA = 16


def shipped_profiles() -> dict[str, Path]:
    """Verify-cost curves measured with `python -m mtp_viz profile`, by file stem."""
    return {p.stem: p for p in sorted(PROFILES.glob("profile-*.json"))}


def read_profile(path: str | Path | None) -> dict[int, float] | None:
    """The verify-cost curve of a profile file (None: no file)."""
    return _profile(path)[0]


def read_exit_agreement(path: str | Path | None) -> dict[int, float] | None:
    """The per-layer early-exit agreement of a profile file, if it measured one."""
    return _profile(path)[1]


def _profile(path: str | Path | None) -> tuple[dict[int, float] | None, dict[int, float] | None]:
    if not path:
        return None, None
    if Path(path).stat().st_size > service.MAX_TRACE_BYTES:
        raise UserError("that profile file is too large")
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        curve = {int(k): float(v) for k, v in data["verify_cost"].items()}
        exits = {int(k): float(v) for k, v in (data.get("exit_agreement") or {}).items()} or None
    except (ValueError, KeyError, TypeError, AttributeError):
        raise UserError("not a profile: expected the JSON that `python -m mtp_viz profile` writes") from None
    return curve, exits


def points_from(paths: list[str]) -> list[dict]:
    """Measured points of uploaded traces, each against the autoregressive trace of its prompt."""
    traces = [service.read_uploaded_trace(p) for p in paths]
    baselines = {tuple(t.prompt_token_ids): t for t in traces if t.strategy == "autoregressive"}
    points = []
    for t in traces:
        point = measured_point(t, baselines.get(tuple(t.prompt_token_ids)))
        if point is not None:
            points.append(point)
    return points


def numbers_html(alpha: float, gamma: int, c: float, verify_cost) -> str:
    tokens = expected_tokens(alpha, gamma)
    lines = [
        f"expected tokens per target forward: <b>{tokens:.2f}</b>",
        f"textbook speedup: <b>{speedup(alpha, gamma, c):.2f}x</b> (best γ = {optimal_gamma(alpha, c, MAX_GAMMA)})",
    ]
    if verify_cost and gamma + 1 in verify_cost:
        measured = speedup(alpha, gamma, c, verify_cost)
        best = optimal_gamma(alpha, c, min(MAX_GAMMA, max(verify_cost) - 1), verify_cost)
        lines.append(
            f"with this device's verify cost ({verify_cost[gamma + 1]:.2f}x a one-token forward for "
            f"{gamma + 1} tokens): <b>{measured:.2f}x</b> (best γ = {best})"
        )
    return "<br>".join(lines)


def build_theory() -> gr.Blocks:
    profiles = shipped_profiles()
    with gr.Blocks() as tab:
        gr.Markdown(notes.THEORY)
        with gr.Row():
            alpha = gr.Slider(0.0, 0.99, value=0.7, step=0.01, label="α: chance a drafted token is accepted")
            gamma = gr.Slider(1, MAX_GAMMA, value=4, step=1, label="γ: draft length")
            c = gr.Slider(0.0, 1.0, value=0.1, step=0.01, label="c: draft forward / target forward")
        numbers = gr.HTML(elem_id="mv-theory-numbers")
        plot = gr.Plot(label="Predicted speedup")
        with gr.Row():
            profile = gr.Dropdown(
                [("(none)", "")] + [(k, str(v)) for k, v in profiles.items()],
                value=str(next(iter(profiles.values()), "")),
                label="Measured verify-cost curve (python -m mtp_viz profile)",
            )
            profile_upload = gr.File(label="…or upload a profile JSON", file_types=[".json"], type="filepath")
            traces = gr.File(
                label="Your runs' traces (with the autoregressive run of the same prompt)",
                file_count="multiple",
                file_types=[".json"],
                type="filepath",
            )
        use_examples = gr.Checkbox(False, label="Show the example traces' measured points")
        gr.Markdown(notes.EXITS)
        exits_plot = gr.Plot(label="Early-exit agreement by layer")

        def update(alpha, gamma, c, profile, uploaded_profile, paths, examples):
            try:
                curve, exits = _profile(uploaded_profile or profile)
                files = list(paths or []) + ([str(p) for p in example_traces().values()] if examples else [])
                points = points_from(files)
            except UserError as e:
                raise gr.Error(str(e)) from None
            gamma = int(gamma)
            return (
                numbers_html(alpha, gamma, c, curve),
                figures.theory_curves(alpha, c, curve, points, MAX_GAMMA),
                figures.exit_agreement_bars(exits),
            )

        inputs = [alpha, gamma, c, profile, profile_upload, traces, use_examples]
        for component in (alpha, gamma, c, profile, use_examples):
            component.change(update, inputs, [numbers, plot, exits_plot], api_visibility="private")
        for component in (profile_upload, traces):
            component.upload(update, inputs, [numbers, plot, exits_plot], api_visibility="private")
        tab.load(update, inputs, [numbers, plot, exits_plot], api_visibility="private")
    return tab
