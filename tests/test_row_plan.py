"""Row plans (mtp_viz.row_plan): a product whose rows depend on the call's row count (as oneDNN's
AMX kernels made bf16 on an Intel Xeon) is found and named, made exact where a plan can, and
reported not lossless where none can, with `auto` passing it over. The stand-ins replace a
format's kernel; the real kernels of this machine are probed in tests/test_weights.py."""

import re

import pytest
import torch
from conftest import decode, perturbed, tiny_model
from test_greedy_identity import PROMPT, _lossless_runs

from mtp_viz import loading, weights_auto
from mtp_viz.kernel_plan import row_plans
from mtp_viz.kernels import RAW_ROWS, STOCK_PLAN, RowPlan, use_fast_linears
from mtp_viz.machine import describe
from mtp_viz.row_plan import (
    PROBED_ROWS,
    applied,
    measure,
    not_lossless,
    plan_of_record,
    products,
    use_row_plans,
)
from mtp_viz.runner import RunRequest, run
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.weights import BF16, FP32, INT8, Q4, Int8Linear, apply_format, head_format

SWITCH = 9  # the stand-in's kernel changes its summation at this many rows
real_int8 = Int8Linear.product


def by_row_count(self, x: torch.Tensor) -> torch.Tensor:
    """Int8's product, but from SWITCH rows on each row comes out 1.6% larger: another kernel."""
    y = real_int8(self, x)
    return y * (1 + 2**-6) if len(x) >= SWITCH else y


def never_the_same(self, x: torch.Tensor) -> torch.Tensor:
    """Int8's product with a little noise: no grouping of rows makes two calls agree."""
    y = real_int8(self, x)
    return y + torch.randn(y.shape, dtype=torch.float32).to(y.dtype) * 1e-2


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_VIZ_CACHE", str(tmp_path))
    loading.forget()  # models loaded with the stand-in are not kept
    yield tmp_path
    loading.forget()


def test_row_plans_pad_and_chunk_the_calls_and_keep_the_rows():
    calls = []

    def product(x):
        calls.append(len(x))
        return x * 2

    x = torch.randn(7, 3)
    assert torch.equal(RowPlan(4, 4)(product, x), x * 2) and calls == [4, 4]
    calls.clear()
    assert torch.equal(RowPlan(4)(product, x[:1]), x[:1] * 2) and calls == [4]
    calls.clear()
    assert torch.equal(RAW_ROWS(product, x), x * 2) and calls == [7]
    calls.clear()
    assert RowPlan(4, 4)(product, x[:0]).shape == (0, 3) and calls == [0]  # an empty call runs as it comes
    calls.clear()
    many = torch.randn(65, 3)  # beyond MAX_ROWS (prefill, training): as it comes
    assert torch.equal(RowPlan(4, 4)(product, many), many * 2) and calls == [65]


def test_a_row_count_dependent_product_is_named_and_made_exact(cache, monkeypatch):
    model = apply_format(tiny_model("llama-2l", seed=0), INT8)
    draft = apply_format(perturbed(model, noise=0.2, seed=10), INT8)
    generation = GenerationSettings(max_new_tokens=40)
    reference, _ = decode(model, "autoregressive", PROMPT, generation)
    monkeypatch.setattr(Int8Linear, "product", by_row_count)
    record = measure(INT8, products(model)[INT8])
    assert re.fullmatch(
        rf"int8 \d+x\d+: a row of a {SWITCH}-row product differs from the one-token product", record["tried"]["as is"]
    )
    chosen = plan_of_record(record)  # calls all below SWITCH rows, or all at or above it
    assert chosen.exact and ((chosen.chunk or 99) < SWITCH or chosen.pad_to >= SWITCH)
    # without a plan the stand-in's verify rows part from autoregressive decoding ...
    use_row_plans(model, {INT8: RAW_ROWS})
    use_row_plans(draft, {INT8: RAW_ROWS})
    parted = [label for label, output, _ in _lossless_runs(model, draft, generation) if output != reference]
    assert "lookahead 5/7/7" in parted
    # ... and under the measured one every lossless strategy is autoregressive decoding again
    plans = {f: plan_of_record(e) for f, e in row_plans(model).items()}
    assert plans[INT8].exact and plans[INT8] != RAW_ROWS
    use_row_plans(model, plans)
    use_row_plans(draft, plans)
    for label, output, _ in _lossless_runs(model, draft, generation):
        assert output == reference, label


def test_a_product_no_plan_makes_exact_is_not_lossless_and_says_so(cache, use_tiny_registry, monkeypatch):
    monkeypatch.setattr(Int8Linear, "product", never_the_same)
    loaded = loading.load_model("tiny", weights=INT8)
    [why] = not_lossless(loaded.model)
    assert re.fullmatch(
        r"int8 \d+x\d+: a row of a 1-row product differs from the one-token product", why
    )  # not even itself
    assert not applied(loaded.model)[INT8].exact
    trace = run(RunRequest(prompt="the cat", model="tiny", weights=INT8, generation=GenerationSettings(4)))
    assert "int8 as is; not lossless on this machine (int8 " in trace.machine["linear"]
    assert "not lossless on this machine" in describe(trace.machine)  # what `run` prints and the UI shows
    # auto does not take it, however fast and close to fp32 it is
    steady = [1.0, 1.0, 1.01, 0.99, 1.0]
    times = {FP32: [30 * t for t in steady], INT8: [10 * t for t in steady], BF16: [20 * t for t in steady]}
    agreement = {INT8: 1.0, BF16: 1.0}
    assert weights_auto.choose(agreement, times, {INT8: False, BF16: True}) == (BF16, True)
    assert weights_auto.choose(agreement, times, {INT8: True, BF16: True}) == (INT8, True)


def test_plans_are_kept_in_the_kernel_plans_record_and_measured_once(cache, monkeypatch):
    model = use_fast_linears(apply_format(tiny_model("llama-2l", seed=0), Q4), STOCK_PLAN)
    first = row_plans(model)
    assert set(first) == {Q4, head_format(Q4)} and all(e["probed_rows"] == list(PROBED_ROWS) for e in first.values())
    assert first[Q4]["machine"]["cpu"] and first[Q4]["cost_ms"]["as is"]["1"] > 0
    [path] = (cache / "kernels").glob("*.json")
    monkeypatch.setattr("mtp_viz.row_plan.measure", lambda *a, **k: pytest.fail("measured twice"))
    assert row_plans(model) == first and path.exists()
