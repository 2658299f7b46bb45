"""Leviathan et al. (2023): what speculative decoding should gain, textbook and on measured hardware.

alpha: probability a drafted token is accepted (i.i.d. per position); gamma: draft length;
c: cost of one draft forward relative to one target forward. The textbook assumes verifying
gamma+1 tokens costs one target forward. `verify_cost` replaces that with a measured curve:
verify_cost[k] = time of one target forward over k tokens / time of a one-token forward.
"""

from collections.abc import Mapping

from mtp_viz.errors import InvalidSettingsError


def _check(alpha: float, gamma: int, c: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise InvalidSettingsError(f"alpha must be in [0, 1], got {alpha}")
    if gamma < 0:
        raise InvalidSettingsError(f"gamma must be >= 0, got {gamma}")
    if c < 0:
        raise InvalidSettingsError(f"c must be >= 0, got {c}")


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens per target forward: (1 − α^(γ+1)) / (1 − α); γ+1 when α = 1."""
    _check(alpha, gamma, 0.0)
    if alpha == 1.0:
        return float(gamma + 1)
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def speedup(alpha: float, gamma: int, c: float, verify_cost: Mapping[int, float] | None = None) -> float:
    """Walltime speedup over autoregressive decoding.

    Textbook: (1 − α^(γ+1)) / ((1 − α)(γc + 1)). With a measured curve the denominator's 1
    becomes verify_cost[γ+1], the relative cost of scoring γ+1 tokens in one forward.
    """
    _check(alpha, gamma, c)
    verify = 1.0 if verify_cost is None else verify_cost[gamma + 1]
    return expected_tokens(alpha, gamma) / (gamma * c + verify)


def optimal_gamma(alpha: float, c: float, max_gamma: int = 32, verify_cost: Mapping[int, float] | None = None) -> int:
    """The draft length with the highest predicted speedup (0: do not speculate)."""
    return max(range(max_gamma + 1), key=lambda g: (speedup(alpha, g, c, verify_cost), -g))  # ties: shorter
