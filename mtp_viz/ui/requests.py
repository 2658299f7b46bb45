"""UI values → a validated RunRequest: numbers that arrive as floats or text, empty choices, the
strategy settings kept for the chosen strategy only, and only the models the app may load."""

import json
import os
from dataclasses import asdict, fields
from pathlib import Path

from mtp_viz.errors import InvalidSettingsError, UnknownModelError
from mtp_viz.loading import HUB_ID
from mtp_viz.registry import load_registry
from mtp_viz.runner import RunRequest
from mtp_viz.strategies import get_strategy
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.strategies.variants import coerce, settings_of
from mtp_viz.weights import AUTO

ANY_MODEL_ENV = "MTP_VIZ_ALLOW_ANY_MODEL"  # 1: the app may load hub ids beyond the registry

# The app's generation defaults: GenerationSettings' own, but shorter answers than the CLI's.
APP_GENERATION = {**asdict(GenerationSettings()), "max_new_tokens": 64}


def model_allowed(name: str) -> bool:
    """The app loads registered models only: a user's string never becomes a path on this disk.
    With ANY_MODEL_ENV=1 other Hugging Face hub ids are allowed too (still never a local path)."""
    if name in load_registry().models:
        return True
    allow = os.environ.get(ANY_MODEL_ENV, "") not in ("", "0", "false", "False")
    return allow and HUB_ID.fullmatch(name) is not None and not Path(name).exists()


def _as_number(name: str, value, kind: type):
    """A UI value as an int or a float: whole numbers arrive as floats (12.0), numbers as text;
    anything else is left to the settings' own checks."""
    what = "a whole number" if kind is int else "a number"
    if isinstance(value, str):
        try:
            return kind(value)
        except ValueError:
            raise InvalidSettingsError(f"{name} must be {what}, got {value!r}") from None
    if kind is int and isinstance(value, float):
        if not value.is_integer():
            raise InvalidSettingsError(f"{name} must be {what}, got {value}")
        return int(value)
    return value


def parse_settings(settings: dict | str | None) -> dict:
    """Strategy settings as given to the API: a dict, its JSON text, or nothing."""
    if isinstance(settings, str):
        try:
            settings = json.loads(settings) if settings.strip() else {}
        except json.JSONDecodeError:
            raise InvalidSettingsError("settings must be a JSON object of strategy settings") from None
    if not isinstance(settings or {}, dict):
        raise InvalidSettingsError("settings must be a JSON object of strategy settings")
    return dict(settings or {})


def build_request(
    prompt: str,
    model: str | None,
    strategy: str,
    draft: str | None = None,
    raw: bool = False,
    settings: dict | None = None,
    compile: str = "auto",
    weights: str = AUTO,
    **values,
) -> RunRequest:
    """UI values (numbers arrive as floats, empty choices as "" or None) → a validated RunRequest.

    `values` holds generation settings by GenerationSettings' names (APP_GENERATION where absent)
    and strategy settings from controls shared by every strategy (one per setting name), of which
    only the chosen strategy's are kept. The `settings` dict names strategy settings on purpose:
    one the strategy does not have is an error. Values are converted to the setting's type."""
    spec = get_strategy(strategy)
    settings = parse_settings(settings)
    generation = {k: values.pop(k) for k in APP_GENERATION if k in values}
    chosen = {**settings_of(strategy, values), **{k: v for k, v in settings.items() if v is not None}}
    strategy_settings = {k: coerce(strategy, k, v) for k, v in chosen.items()}
    kinds = {f.name: type(f.default) for f in fields(GenerationSettings)}
    generation = {k: _as_number(k, v, kinds[k]) for k, v in {**APP_GENERATION, **generation}.items()}
    draft = (draft or None) if spec.needs_draft else None
    for name in (model, draft):
        if name and not model_allowed(name):
            raise UnknownModelError(
                f"unknown model {name!r}: the app loads the models in its registry "
                f"({', '.join(load_registry().models)}); set {ANY_MODEL_ENV}=1 to allow other hub ids"
            )
    return RunRequest(
        prompt=prompt,
        model=model or None,
        strategy=strategy,
        draft=draft,
        raw=bool(raw),
        generation=GenerationSettings(**generation),
        strategy_settings=strategy_settings,
        compile=compile or "auto",
        weights=weights or AUTO,
    )
