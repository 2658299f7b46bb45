"""Leviathan et al.'s formulas against worked values."""

from fractions import Fraction

import pytest

from mtp_viz.errors import InvalidSettingsError
from mtp_viz.theory import expected_tokens, optimal_gamma, speedup


def _series_speedup(alpha: Fraction, gamma: int, c: Fraction) -> Fraction:
    """Leviathan et al.'s speedup recomputed exactly, from its definition rather than the closed
    form: expected tokens per step is sum_{i=0..gamma} alpha^i, a step costs gamma*c + 1 target forwards."""
    return sum(alpha**i for i in range(gamma + 1)) / (gamma * c + 1)


def test_worked_example_alpha_08_c_005():
    alpha, c = Fraction(4, 5), Fraction(1, 20)
    exact = {gamma: _series_speedup(alpha, gamma, c) for gamma in range(0, 30)}
    assert exact[8] == Fraction(1690981, 546875)  # 3.09208 = (1 - 0.8^9) / (0.2 * 1.4)
    assert optimal_gamma(0.8, 0.05) == max(exact, key=exact.get) == 8
    for gamma in (1, 7, 8, 9, 20):
        assert speedup(0.8, gamma, 0.05) == pytest.approx(float(exact[gamma]), rel=1e-12, abs=0)
    assert speedup(0.8, 7, 0.05) < speedup(0.8, 8, 0.05) > speedup(0.8, 9, 0.05)


def test_expected_tokens_edges():
    assert expected_tokens(0.0, 5) == 1.0  # nothing accepted: the target's own token
    assert expected_tokens(1.0, 5) == 6.0  # everything accepted plus the bonus
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert speedup(0.3, 0, 0.5) == 1.0  # gamma 0 is autoregressive decoding


def test_a_measured_verify_cost_lowers_the_prediction_and_the_best_gamma():
    flat = {k: 1.0 for k in range(1, 34)}
    cpu_like = {1: 1.0, **{k: 2.0 for k in range(2, 34)}}  # a multi-token forward costs 2x (this CPU)
    assert speedup(0.8, 8, 0.05, flat) == speedup(0.8, 8, 0.05)
    assert speedup(0.8, 8, 0.05, cpu_like) == pytest.approx(speedup(0.8, 8, 0.05) * 1.4 / 2.4)
    assert optimal_gamma(0.3, 0.1, verify_cost=cpu_like) == 0  # low acceptance: do not speculate


@pytest.mark.parametrize("args", [(-0.1, 3, 0.1), (1.1, 3, 0.1), (0.5, -1, 0.1), (0.5, 3, -1)])
def test_invalid_inputs(args):
    with pytest.raises(InvalidSettingsError):
        speedup(*args)
