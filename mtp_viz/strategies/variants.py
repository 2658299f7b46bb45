"""Strategy settings as people and forms give them: "conf_adapt:tau=0.8:k=4" variants, typed
text, one set of controls for every strategy, and the device's defaults for the rest."""

from dataclasses import fields
from typing import Any

from mtp_viz.errors import InvalidSettingsError
from mtp_viz.strategies import STRATEGIES, get_strategy
from mtp_viz.strategies.settings import for_device


def setting_names(strategy: str) -> set[str]:
    return {f.name for f in fields(get_strategy(strategy).settings_cls)}


def settings_of(strategy: str, offered: dict[str, Any]) -> dict[str, Any]:
    """The offered values this strategy has a setting for (None means unset): for callers, like the
    UI and the bench, that hold one set of controls for every strategy."""
    known = setting_names(strategy)
    return {k: v for k, v in offered.items() if k in known and v is not None}


def coerce(strategy: str, name: str, value: Any) -> Any:
    """A setting value as typed by a person (text) or a UI (floats for integers) → the setting's type."""
    field = next((f for f in fields(get_strategy(strategy).settings_cls) if f.name == name), None)
    if field is None:
        allowed = ", ".join(sorted(setting_names(strategy))) or "none"
        raise InvalidSettingsError(f"strategy {strategy} has no setting {name} (settings: {allowed})")
    kind = type(field.default)
    if kind is bool and isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    if kind is int and isinstance(value, (str, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except ValueError:
            raise InvalidSettingsError(f"{name} must be a whole number, got {value!r}") from None
        if not number.is_integer():
            raise InvalidSettingsError(f"{name} must be a whole number, got {value}")
        return int(number)
    if kind is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise InvalidSettingsError(f"{name} must be a number, got {value!r}") from None
    return value


def split_variants(text: str) -> list[str]:
    """ "a,b:tree=0,1,00,c" → ["a", "b:tree=0,1,00", "c"]: a comma starts a new variant only
    where a strategy name follows, so settings whose values hold commas (MTP trees) survive."""
    variants: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part.split(":")[0] in STRATEGIES or not variants:
            variants.append(part)
        else:
            variants[-1] += "," + part
    return variants


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """ "conf_adapt:tau=0.8:k=4" → ("conf_adapt", {"tau": 0.8, "k": 4}); a plain name has no settings."""
    name, *pairs = text.strip().split(":")
    get_strategy(name)
    values = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise InvalidSettingsError(f"expected key=value after {name}:, got {pair!r}")
        values[key.strip()] = coerce(name, key.strip(), value.strip())
    return name, values


def build_strategy_settings(strategy: str, values: dict[str, Any], device_type: str):
    """Keyword values → the strategy's frozen settings, the device's defaults for the rest
    ("cpu", "cuda", ...); unknown keys are an error."""
    spec = get_strategy(strategy)
    known = setting_names(strategy)
    unknown = sorted(set(values) - known)
    if unknown:
        allowed = ", ".join(sorted(known)) or "none"
        raise InvalidSettingsError(f"strategy {strategy} has no setting {', '.join(unknown)} (settings: {allowed})")
    return for_device(spec.settings_cls, device_type, values)
