"""The few-row linear product (mtp_viz.kernels) computes what F.linear computes, and the path it
takes per row count is chosen from timings: fast only where it clearly wins, stock otherwise."""

import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mtp_viz import kernels
from mtp_viz.kernels import (
    FAST,
    FIXED_PLAN,
    MAX_ROWS,
    STOCK,
    STOCK_PLAN,
    FastLinear,
    Plan,
    choose,
    fast_linear,
    plan_of,
    tune,
    use_fast_linears,
)

ALL_FAST = Plan(tuple(range(MAX_ROWS + 1)), FAST)  # every row count by W @ xᵀ, unpadded


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 7, MAX_ROWS, MAX_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("plan", [FIXED_PLAN, ALL_FAST], ids=["padded", "unpadded"])
def test_fast_linear_equals_f_linear(rows, bias, plan):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 32, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    x = torch.randn(1, rows, 32, generator=g)
    y = fast_linear(x, w, b, plan)
    assert y.shape == (1, rows, 48) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_fast_linear_keeps_gradients():
    w = torch.randn(8, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    fast_linear(x, w, plan=FIXED_PLAN).square().sum().backward()
    w_ref, x_ref = w.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    F.linear(x_ref, w_ref).square().sum().backward()
    torch.testing.assert_close(w.grad, w_ref.grad)
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_other_dtypes_and_the_stock_plan_fall_back_to_f_linear(monkeypatch):
    calls = []
    real = F.linear
    monkeypatch.setattr(kernels.F, "linear", lambda *a: calls.append(1) or real(*a))
    w, x = torch.randn(8, 4), torch.randn(1, 4)
    fast_linear(x, w, plan=FIXED_PLAN)
    assert calls == []  # the fast path ran
    fast_linear(x.bfloat16(), w.bfloat16(), plan=FIXED_PLAN)
    assert calls == [1]
    fast_linear(x, w, plan=STOCK_PLAN)
    assert calls == [1, 1]
    fast_linear(torch.randn(MAX_ROWS + 1, 4), w, plan=ALL_FAST)  # beyond the planned rows
    assert calls == [1, 1, 1]


def test_use_fast_linears_keeps_the_modules_and_their_weights():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2, bias=False))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 4)
    expected = model(x)
    use_fast_linears(model, FIXED_PLAN)
    assert all(type(m) is FastLinear for m in (model[0], model[2]))
    assert isinstance(model[0], nn.Linear)
    assert plan_of(model) is FIXED_PLAN
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    torch.testing.assert_close(model(x), expected)


def test_registry_models_use_it_on_a_cpu_in_float32_only(use_tiny_registry):
    from mtp_viz.models import load_model

    linears = [m for m in load_model("tiny", "cpu", "float32").model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is FastLinear for m in linears)
    bf16 = [m for m in load_model("tiny", "cpu", "bfloat16").model.modules() if isinstance(m, nn.Linear)]
    assert bf16 and all(type(m) is nn.Linear for m in bf16)


# --- the choice, from injected timings ---------------------------------------------------------

ROWS = (1, 2, 4, 8)


def timings(stock: dict[int, float], fast: dict[int, float], rounds: int = 5, jitter=None):
    """Timings as `measure` returns them; `jitter(way, rows, round)` adds per-round noise."""
    jitter = jitter or (lambda way, rows, i: 0.0)
    out = {}
    for way, table in ((STOCK, stock), (FAST, fast)):
        for rows, t in table.items():
            out[way, rows] = [t + jitter(way, rows, i) for i in range(rounds)]
    return out


def test_fast_wins_everywhere_and_pads_to_the_cheapest_measured_count():
    padded = choose(timings({1: 10, 2: 20, 4: 30, 8: 50}, {1: 8, 2: 6, 4: 7, 8: 20}))
    assert padded[1] == 2 and padded[2] == 2  # 2 rows cost less than 1 the fast way
    assert padded[3] == padded[4] == 4
    assert all(padded[r] == 8 for r in range(5, 9))
    assert all(p == 0 for p in padded[9:])  # nothing measured beyond 8: stock
    assert padded[0] == 0


def test_stock_wins_everywhere():
    assert set(choose(timings({1: 5, 2: 6, 4: 7, 8: 9}, {1: 9, 2: 9, 4: 9, 8: 12}))) == {0}


def test_mixed_by_row_count():
    padded = choose(timings({1: 10, 2: 11, 4: 12, 8: 30}, {1: 14, 2: 15, 4: 16, 8: 20}))
    assert padded[1:5] == (0, 0, 0, 0)
    assert padded[5:9] == (8, 8, 8, 8)


def test_a_win_inside_the_margin_or_the_noise_goes_to_stock():
    # 3% faster: inside the margin
    assert set(choose(timings({1: 10, 2: 10}, {1: 9.7, 2: 9.7}))) == {0}
    # 20% faster in the median, but slower in 2 of 5 rounds: too noisy to tell
    noisy = timings({1: 10}, {1: 8}, jitter=lambda way, rows, i: 5.0 if (way, i) in ((FAST, 0), (FAST, 1)) else 0.0)
    assert choose(noisy)[1] == 0
    # the same win, steady in every round: fast
    assert choose(timings({1: 10}, {1: 8}))[1] == 1


def test_plan_describes_itself():
    assert STOCK_PLAN.describe() == "stock"
    plan = Plan(tuple([0, 2, 2, 4, 4, 5] + [0] * (MAX_ROWS - 5)))
    assert plan.describe() == f"fast 1-2→2, 3-4→4, 5; stock 6-{MAX_ROWS}"


def test_modes_and_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_VIZ_CACHE", str(tmp_path))
    model = nn.Sequential(nn.Linear(4, 8))
    measured = []

    def fake_measure(m):
        measured.append(m)
        return timings({r: 10.0 for r in ROWS}, {r: 5.0 for r in ROWS})

    monkeypatch.setenv(kernels.ENV, STOCK)
    assert tune(model, fake_measure) is STOCK_PLAN
    monkeypatch.setenv(kernels.ENV, FAST)
    assert tune(model, fake_measure) is FIXED_PLAN
    assert measured == []
    monkeypatch.setenv(kernels.ENV, "auto")
    first = tune(model, fake_measure)
    assert first.source == "measured" and first.padded[1] == 1 and measured == [model]
    record = json.loads(next((tmp_path / "kernels").glob("*.json")).read_text())
    assert record["machine"]["cpu"] and record["padded"] == list(first.padded)
    again = tune(model, fake_measure)  # a later load: from the cache, nothing timed
    assert again.source == "cached" and again.padded == first.padded and measured == [model]
    other = nn.Sequential(nn.Linear(4, 16))  # other shapes: measured anew
    tune(other, fake_measure)
    assert measured == [model, other]


def test_measure_times_both_ways_at_every_row_count():
    result = kernels.measure([torch.randn(8, 4)], rows=(1, 3), rounds=2)
    assert set(result) == {(STOCK, 1), (FAST, 1), (STOCK, 3), (FAST, 3)}
    assert all(len(ts) == 2 and all(t > 0 for t in ts) for ts in result.values())
