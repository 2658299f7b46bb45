"""The strategy registry: stable name → StrategySpec (settings class, run function)."""

from mtp_viz.errors import UnknownStrategyError
from mtp_viz.strategies import (
    autoregressive,
    conf_adapt,
    eagle,
    lookahead,
    mask_spec,
    mtp_heads,
    prompt_lookup,
    self_speculative,
    speculative,
)
from mtp_viz.strategies.base import StrategySpec

STRATEGIES: dict[str, StrategySpec] = {
    s.SPEC.name: s.SPEC
    for s in (
        autoregressive,
        speculative,
        prompt_lookup,
        lookahead,
        self_speculative,
        mtp_heads,
        eagle,
        conf_adapt,
        mask_spec,
    )
}


def get_strategy(name: str) -> StrategySpec:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise UnknownStrategyError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}") from None
