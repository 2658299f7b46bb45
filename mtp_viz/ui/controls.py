"""Strategy-setting controls, derived from the strategies' settings dataclasses: one control per
setting name (strategies that share a name share the control), shown for the strategies that
have it and reset to the chosen strategy's default. Adding a setting to a strategy adds it here."""

from dataclasses import Field, fields

import gradio as gr

from mtp_viz.loading import resolve_device
from mtp_viz.strategies import STRATEGIES
from mtp_viz.strategies.settings import device_defaults

SLIDER_MAX_STEPS = 256  # integer ranges up to this get a slider, wider ones a number box


def setting_fields() -> dict[str, Field]:
    """Every setting name across strategies → its field (the first strategy's, for shared names)."""
    out: dict[str, Field] = {}
    for spec in STRATEGIES.values():
        for f in fields(spec.settings_cls):
            out.setdefault(f.name, f)
    return out


def owners(name: str) -> set[str]:
    return {n for n, s in STRATEGIES.items() if name in {f.name for f in fields(s.settings_cls)}}


def control(f: Field) -> gr.components.Component:
    m, default = f.metadata, f.default
    label = m.get("label") or f.name
    info = m.get("help") or None
    if isinstance(default, bool):
        return gr.Checkbox(default, label=label, info=info, visible=False)
    if isinstance(default, int):
        low, high = m.get("low", 0), m.get("high", 0)
        if high - low <= SLIDER_MAX_STEPS:
            return gr.Slider(low, high, value=default, step=1, label=label, info=info, visible=False)
        return gr.Number(default, precision=0, minimum=low, maximum=high, label=label, info=info, visible=False)
    if isinstance(default, float):
        step = m.get("step") or 0.01
        return gr.Slider(m["low"], m["high"], value=default, step=step, label=label, info=info, visible=False)
    if m.get("choices"):
        return gr.Dropdown(list(m["choices"]), value=default, label=label, info=info, visible=False)
    return gr.Textbox(default, label=label, info=info, visible=False)


def build_controls() -> dict[str, gr.components.Component]:
    """name → control, created in the current Blocks context."""
    return {name: control(f) for name, f in setting_fields().items()}


def show_for(strategy: str, names: list[str]) -> list:
    """Updates for the controls `names`: visible with the strategy's default on this machine's
    device (a CPU's or a GPU's), or hidden."""
    known = strategy in STRATEGIES
    defaults = device_defaults(STRATEGIES[strategy].settings_cls, resolve_device(None).type) if known else {}
    return [gr.update(visible=True, value=defaults[n]) if n in defaults else gr.update(visible=False) for n in names]
