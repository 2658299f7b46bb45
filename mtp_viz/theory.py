"""Leviathan et al. (2023): what speculative decoding should gain, textbook and on measured hardware.

alpha: probability a drafted token is accepted (i.i.d. per position); gamma: draft length;
c: cost of one draft forward relative to one target forward. The textbook assumes verifying
gamma+1 tokens costs one target forward. `verify_cost` replaces that with a measured curve:
verify_cost[k] = time of one target forward over k tokens / time of a one-token forward.
"""

from collections.abc import Mapping

from mtp_viz.errors import InvalidSettingsError
from mtp_viz.trace import timed


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


def measured_point(trace, baseline) -> dict | None:
    """What a chain-drafting run measured, on the theory's axes: per-token acceptance α (accepted
    over judged; tokens never judged excluded), mean draft length γ, draft cost ratio c (a draft
    forward over an autoregressive step of `baseline`, the matching autoregressive run), and the
    measured speedup. None for runs that drafted nothing, or whose steps are not timed."""
    steps = [s for s in trace.steps if s.drafted]
    if not steps or baseline is None or not baseline.steps or not (timed(trace.steps) and timed(baseline.steps)):
        return None  # no drafts, no baseline, or an engine that does not time its steps (c is unknown)
    accepted = sum(s.verdicts.count("accepted") for s in steps)
    judged = accepted + sum(s.verdicts.count("rejected") for s in steps)
    one_token_s = sum(s.step_s for s in baseline.steps) / len(baseline.steps)
    forwards = sum(s.draft_forwards for s in steps)
    draft_s = sum(s.draft_s for s in steps)
    per_draft = draft_s / forwards if forwards else draft_s / sum(len(s.drafted) for s in steps)
    base_tps = baseline.summary["tokens_per_s"]
    return {
        "label": trace.strategy + (f" ({trace.draft_model})" if trace.draft_model else ""),
        "alpha": accepted / judged if judged else 0.0,
        "gamma": sum(len(s.drafted) for s in steps) / len(steps),
        "c": per_draft / one_token_s if one_token_s > 0 else 0.0,
        "speedup": trace.summary["tokens_per_s"] / base_tps if base_tps else float("nan"),
    }


CONCURRENCY_ASSUMPTIONS = (
    "Predicted from this device's timed forwards of B sequences × k tokens: every user runs the "
    "same strategy with the tokens per forward measured alone, a draft forward costs c of a target "
    "forward at every B, drafting by lookup, heads or masks is free, and a forward's extra rows cost "
    "what the base model's do (an adapter's own terms are left out, so the B = 1 point can sit "
    "above the measured speedup)."
)


def interpolated(cost: Mapping[int, float], k: float) -> float:
    """A cost curve (k → relative cost) at a fractional k, linear between measured points (held
    flat past the ends)."""
    ks = sorted(cost)
    if k <= ks[0]:
        return cost[ks[0]]
    for low, high in zip(ks, ks[1:], strict=False):
        if k <= high:
            return cost[low] + (cost[high] - cost[low]) * (k - low) / (high - low)
    return cost[ks[-1]] * k / ks[-1]  # past the last point: proportional to the tokens


def concurrency_speedup(
    tokens_per_forward: float,
    scored_per_forward: float,
    draft_forwards_per_forward: float,
    c: float | Mapping[int, float],
    batch_cost: Mapping[int, Mapping[int, float]],
) -> dict[int, float]:
    """B → predicted speedup over autoregressive decoding when B users share the device, each
    running the strategy: tokens_per_forward tokens for a forward scoring scored_per_forward tokens
    per sequence (cost batch_cost[B][k] of a B × 1 forward), plus draft forwards at c each (one c,
    or c per B as a serving engine measured it: B → a drafted token's cost / a B × 1 step)."""
    per_batch = c if isinstance(c, Mapping) else dict.fromkeys(batch_cost, c)
    if tokens_per_forward <= 0 or scored_per_forward < 1 or any(v < 0 for v in per_batch.values()):
        raise InvalidSettingsError("need tokens per forward > 0, tokens scored per forward >= 1 and c >= 0")
    return {
        b: tokens_per_forward / (interpolated(cost, scored_per_forward) + draft_forwards_per_forward * per_batch[b])
        for b, cost in sorted(batch_cost.items())
        if b in per_batch
    }


def break_even(speedups: Mapping[int, float]) -> int | None:
    """The smallest concurrency at which the predicted speedup falls below 1x, or None."""
    return next((b for b, s in sorted(speedups.items()) if s < 1.0), None)
