"""Loading as one pipeline (mtp_viz.loading): a load is keyed by its registry entry, the record
says what was applied, derived models share their base's modules and format, `auto` is read from
its record, one place knows the default model, and each drafter kind loads against a target."""

import json

import pytest
import torch

from mtp_viz import weights_auto
from mtp_viz.drafters.kinds import DrafterKind
from mtp_viz.errors import UserError
from mtp_viz.kernels import FastLinear
from mtp_viz.loading import DrafterRequest, load_drafting, load_model, model_name
from mtp_viz.loading.drafters import registered
from mtp_viz.strategies import STRATEGIES
from mtp_viz.weights import FP32, INT8
from tests.conftest import save_tiny_dir


def registry(root, models, defaults=None):
    path = root / "models.yaml"
    path.write_text(json.dumps({"defaults": defaults or {"cpu": models[0]["id"]}, "models": models}))
    return path


@pytest.fixture
def two_registries(tmp_path, monkeypatch):
    """Two registries that both name a model "t", with different weights."""
    save_tiny_dir(tmp_path / "a", seed=0)
    save_tiny_dir(tmp_path / "b", seed=1)
    (tmp_path / "ra").mkdir()
    (tmp_path / "rb").mkdir()
    first = registry(
        tmp_path / "ra", [{"id": "t", "label": "t", "sources": [{"kind": "local", "path": str(tmp_path / "a")}]}]
    )
    second = registry(
        tmp_path / "rb", [{"id": "t", "label": "t", "sources": [{"kind": "local", "path": str(tmp_path / "b")}]}]
    )
    return first, second


def test_a_load_is_keyed_by_its_registry_entry_not_its_name(two_registries, monkeypatch):
    first, second = two_registries
    monkeypatch.setenv("MTP_VIZ_MODELS", str(first))
    a = load_model("t", "cpu", "float32")
    monkeypatch.setenv("MTP_VIZ_MODELS", str(second))
    b = load_model("t", "cpu", "float32")
    assert a.source != b.source and a.model is not b.model
    assert not torch.equal(a.model.lm_head.weight, b.model.lm_head.weight)
    monkeypatch.setenv("MTP_VIZ_MODELS", str(first))
    assert load_model("t", "cpu", "float32") is a  # cached per entry


def test_the_record_says_what_was_applied(use_tiny_registry):
    loaded = load_model("tiny", "cpu", "float32", weights=INT8)
    assert loaded.weights == INT8 and loaded.weights_detail.startswith(INT8)
    assert loaded.plan is not None and loaded.linear.startswith(f"{INT8} weight-only kernels; head ")
    fp32 = load_model("tiny", "cpu", "float32")
    assert fp32.linear.startswith(fp32.plan.describe())
    assert isinstance(fp32.model.lm_head, FastLinear)


def test_the_default_model_is_named_in_one_place(use_tiny_registry):
    assert model_name(None) == model_name(None, "cpu") == "tiny"
    assert model_name("tiny-draft") == "tiny-draft"
    assert load_model(None).name == "tiny"


def test_auto_reads_its_record_and_never_measures_through_the_loader(use_tiny_registry, tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_VIZ_CACHE", str(tmp_path))
    reference = load_model("tiny", "cpu", "float32")
    record = {"chosen": INT8, "settled": True, "formats": {}, "measured_at": "2026-12-05T00:00:00+00:00"}
    monkeypatch.setattr(weights_auto, "cached_record", lambda name, model: record if model is reference.model else None)
    monkeypatch.setattr(weights_auto, "describe_record", lambda r: f"{r['chosen']} (recorded)")
    monkeypatch.setattr(weights_auto, "measure", lambda loaded: pytest.fail("measured although recorded"))
    loaded = load_model("tiny", weights="auto")
    assert (loaded.weights, loaded.weights_why) == (INT8, "int8 (recorded)")
    assert load_model("tiny", weights=INT8).model is loaded.model  # one model for auto and its format


def test_every_strategy_names_the_drafter_kinds_it_uses():
    kinds = {name: spec.drafters(spec.settings_cls()) for name, spec in STRATEGIES.items()}
    assert kinds["speculative"] == (DrafterKind.DRAFT_MODEL,) and STRATEGIES["speculative"].needs_draft
    assert kinds["mtp_heads"] == (DrafterKind.HEADS,)
    assert kinds["mask_spec"] == (DrafterKind.MASKS,)
    assert kinds["eagle"] == (DrafterKind.EAGLE3,)
    assert kinds["conf_adapt"] == (DrafterKind.MASKS, DrafterKind.HEADS)  # auto: mask tokens where the model has them
    for name in ("autoregressive", "prompt_lookup", "lookahead", "self_speculative"):
        assert kinds[name] == (), name


def test_a_draft_model_kind_loads_the_registered_draft_in_the_run_format(use_tiny_registry):
    target = load_model("tiny", "cpu", "float32")
    request = DrafterRequest("speculative", device="cpu", dtype="float32", weights=INT8)
    drafting = load_drafting(target, (DrafterKind.DRAFT_MODEL,), request)
    assert drafting.target is target and drafting.name == "tiny-draft"
    assert drafting.draft.weights == INT8 and drafting.heads is None and drafting.eagle3 is None
    assert registered("tiny", (DrafterKind.DRAFT_MODEL,)) == ("tiny", "tiny-draft")


def test_a_kind_the_target_lacks_is_a_clear_error_or_falls_through(use_tiny_registry):
    target = load_model("tiny-draft", "cpu", "float32")
    with pytest.raises(UserError, match="strategy speculative needs a draft model; none is registered for tiny-draft"):
        load_drafting(target, (DrafterKind.DRAFT_MODEL,), DrafterRequest("speculative"))
    with pytest.raises(UserError, match="no MTP heads are registered for tiny-draft"):
        load_drafting(target, (DrafterKind.MASKS, DrafterKind.HEADS), DrafterRequest("conf_adapt"))
    # masks alone on a model without a mask token: the target as it is, for the strategy to refuse
    drafting = load_drafting(target, (DrafterKind.MASKS,), DrafterRequest("mask_spec"))
    assert drafting.target is target and drafting.mask_token_id is None and drafting.name is None


def test_a_derived_model_shares_its_base_modules_in_its_format(tmp_path, monkeypatch):
    save_tiny_dir(tmp_path / "base")
    path = registry(
        tmp_path,
        [
            {"id": "b", "label": "b", "sources": [{"kind": "local", "path": "base"}]},
            {"id": "b-exit", "label": "exit", "sources": [{"kind": "early_exit", "base": "b", "layers": 1}]},
        ],
    )
    monkeypatch.setenv("MTP_VIZ_MODELS", str(path))
    view = load_model("b-exit", "cpu", "float32", weights=INT8)
    base = load_model("b", "cpu", "float32", weights=INT8)
    assert view.model.model.layers[0] is base.model.model.layers[0]
    assert view.weights == base.weights == INT8 and view.source == "early_exit:b[:1]"
    assert load_model("b-exit", "cpu", "float32").weights == FP32  # another format: another base load
