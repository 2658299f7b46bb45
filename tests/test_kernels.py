"""The few-row linear product (mtp_viz.kernels) computes what F.linear computes, by whichever path
its plan names per row count (how the plan is measured: tests/test_linear_plan.py)."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mtp_viz import kernels
from mtp_viz.kernels import (
    FAST,
    FIXED_PLAN,
    MAX_ROWS,
    STOCK_PLAN,
    FastLinear,
    Plan,
    fast_linear,
    plan_of,
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


def test_a_fast_linear_is_made_of_the_linear_it_replaces():
    """use_fast_linears puts a FastLinear in each plain linear's place: the same parameter objects
    (no copy), the old module's hooks and mode; a bare linear comes back as one; a module that calls
    fast_linear itself (a Planned one: a drafter's reduced head) gets the plan too."""
    from mtp_viz.drafters.vocab import ReducedHead

    first = nn.Linear(4, 8)
    seen = []
    first.register_forward_hook(lambda _m, _i, out: seen.append(out.shape) or out * 2)
    head = ReducedHead(torch.randn(10, 8), torch.tensor([1, 3, 5]), vocab_size=10)
    model = nn.Sequential(first, nn.ReLU(), head).eval()
    x = torch.randn(2, 4)
    expected = model(x)
    assert use_fast_linears(model, FIXED_PLAN) is model
    fast = model[0]
    assert type(fast) is FastLinear and fast is not first and not fast.training
    assert fast.weight is first.weight and fast.bias is first.bias
    torch.testing.assert_close(model(x), expected)
    assert len(seen) == 2  # the hook moved with the module
    assert head.plan is FIXED_PLAN and plan_of(model) is FIXED_PLAN
    bare = nn.Linear(4, 2)
    made = use_fast_linears(bare, FIXED_PLAN)
    assert type(made) is FastLinear and made.weight is bare.weight and made.plan is FIXED_PLAN
    linear = nn.Linear(2, 2)
    shared = use_fast_linears(nn.Sequential(nn.Sequential(linear), nn.Sequential(linear)), FIXED_PLAN)
    assert type(shared[0][0]) is FastLinear and shared[0][0] is shared[1][0]  # one module under two parents stays one


def test_registry_models_use_it_on_a_cpu_in_float32_only(use_tiny_registry):
    from mtp_viz.loading import load_model

    linears = [m for m in load_model("tiny", "cpu", "float32").model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is FastLinear for m in linears)
    bf16 = [m for m in load_model("tiny", "cpu", "bfloat16").model.modules() if isinstance(m, nn.Linear)]
    assert bf16 and all(type(m) is nn.Linear for m in bf16)
