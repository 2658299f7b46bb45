"""Strategy settings declared once: each field's default, label, range and choices (the UI, the
CLI and validation read them from here), and the checks every settings class runs."""

import math
from dataclasses import field, fields
from typing import Any

from mtp_viz.errors import InvalidSettingsError

MAX_TOP_K = 1_000_000
MAX_TEMPERATURE = 100.0


def check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSettingsError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise InvalidSettingsError(f"{name} must be between {low} and {high}, got {value}")


def check_float(name: str, value: Any, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidSettingsError(f"{name} must be a finite number, got {value!r}")
    if not low <= value <= high:
        raise InvalidSettingsError(f"{name} must be between {low} and {high}, got {value}")


def setting(default, label: str, *, low=None, high=None, choices=None, step=None, gpu=None, help: str = ""):
    """A strategy setting: its default, and what the UI, the CLI and validation need to know.

    `default` is the default on a CPU; `gpu`, where given, the default on an accelerator, where a
    wider forward costs little more than a narrow one, so longer drafts and bigger trees pay."""
    meta = {"label": label, "low": low, "high": high, "choices": choices, "step": step, "help": help, "gpu": gpu}
    return field(default=default, metadata=meta)


def device_defaults(settings_cls: type, device_type: str) -> dict[str, Any]:
    """Every setting's default on this kind of device ("cpu", "cuda", "mps", ...)."""
    on_cpu = device_type == "cpu"
    return {
        f.name: f.default if on_cpu or f.metadata.get("gpu") is None else f.metadata["gpu"]
        for f in fields(settings_cls)
    }


def for_device(settings_cls: type, device_type: str, values: dict[str, Any]):
    """The settings for a run on this kind of device: `values`, the device's defaults for the rest."""
    return settings_cls(**{**device_defaults(settings_cls, device_type), **values})


def check_settings(settings) -> None:
    """Validate every `setting` field of a frozen settings dataclass: type, range, choices."""
    for f in fields(settings):
        m, value = f.metadata, getattr(settings, f.name)
        if isinstance(f.default, bool):
            if not isinstance(value, bool):
                raise InvalidSettingsError(f"{f.name} must be true or false, got {value!r}")
        elif isinstance(f.default, int):
            check_int(f.name, value, m.get("low", 0), m.get("high", MAX_TOP_K))
        elif isinstance(f.default, float):
            check_float(f.name, value, m.get("low", 0.0), m.get("high", MAX_TEMPERATURE))
        elif m.get("choices") and value not in m["choices"]:
            raise InvalidSettingsError(f"{f.name} must be one of {', '.join(m['choices'])}, got {value!r}")
        elif not isinstance(value, str):
            raise InvalidSettingsError(f"{f.name} must be text, got {value!r}")
