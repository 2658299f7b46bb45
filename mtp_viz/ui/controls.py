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


def control(f: Field, value=None, visible: bool = False) -> gr.components.Component:
    """The control of setting `f` (its kind from the field's default), holding `value` if given."""
    m, default = f.metadata, f.default
    value = default if value is None else value
    label = m.get("label") or f.name
    shown = dict(label=label, info=m.get("help") or None, visible=visible)
    if isinstance(default, bool):
        return gr.Checkbox(value, **shown)
    if isinstance(default, int):
        low, high = m.get("low", 0), m.get("high", 0)
        if high - low <= SLIDER_MAX_STEPS:
            return gr.Slider(low, high, value=value, step=1, **shown)
        return gr.Number(value, precision=0, minimum=low, maximum=high, **shown)
    if isinstance(default, float):
        return gr.Slider(m["low"], m["high"], value=value, step=m.get("step") or 0.01, **shown)
    if m.get("choices"):
        return gr.Dropdown(list(m["choices"]), value=value, **shown)
    return gr.Textbox(value, **shown)


def defaults_here(strategy: str) -> dict:
    """The strategy's settings on this machine's device (a CPU's or a GPU's); {} for an unknown one."""
    known = strategy in STRATEGIES
    return device_defaults(STRATEGIES[strategy].settings_cls, resolve_device(None).type) if known else {}


def build_controls(strategy: str = "", values: dict | None = None) -> dict[str, gr.components.Component]:
    """name → control, created in the current Blocks context: `strategy`'s shown, holding `values`
    (a recorded run's settings) where given and its defaults here elsewhere; the others hidden."""
    shown = defaults_here(strategy)
    shown |= {k: v for k, v in (values or {}).items() if k in shown}
    return {name: control(f, shown.get(name), name in shown) for name, f in setting_fields().items()}


def show_for(strategy: str, names: list[str]) -> list:
    """Updates for the controls `names`: visible with the strategy's default on this machine's
    device, or hidden."""
    defaults = defaults_here(strategy)
    return [gr.update(visible=True, value=defaults[n]) if n in defaults else gr.update(visible=False) for n in names]
