"""Loading as one pipeline that goes down, the same steps in the same order for every model a
run needs: locate and read (mtp_viz.loading.sources) or derive from a loaded base
(mtp_viz.loading.derive) → apply the weight format (mtp_viz.weights) → apply the kernel plan
(mtp_viz.kernels, read or measured per machine in one pass by mtp_viz.kernel_plan) → record
what was applied in the LoadedModel. MTP heads go through the same format and kernel steps,
in their target's format and on its plan.

Loads are cached per LoadSpec (its registry entry included) for the process, under one lock."""

import threading
from dataclasses import replace
from pathlib import Path
from weakref import WeakKeyDictionary

from torch import nn

from mtp_viz.drafters.heads import MTPHeads, load_heads
from mtp_viz.kernel_plan import tune
from mtp_viz.kernels import STOCK_PLAN, Plan, use_fast_linears
from mtp_viz.loading.derive import derive, own_layers
from mtp_viz.loading.loaded import LoadedModel, eos_ids
from mtp_viz.loading.sources import described, read
from mtp_viz.loading.spec import LoadSpec
from mtp_viz.row_plan import describe as describe_rows
from mtp_viz.weights import FP32, apply_format
from mtp_viz.weights import describe as describe_weights

load_lock = threading.Lock()  # every load: models, heads, drafters
_loaded: dict[LoadSpec, LoadedModel] = {}
_heads: WeakKeyDictionary = WeakKeyDictionary()  # the target's model → {heads folder: its heads}


def load(spec: LoadSpec) -> LoadedModel:
    """The model `spec` names, loaded once per process."""
    with load_lock:
        return _load(spec)


def _load(spec: LoadSpec) -> LoadedModel:  # under load_lock
    if spec in _loaded:
        return _loaded[spec]
    base_spec = spec.base
    if base_spec is not None:  # a derived model shares its base's modules, tokenizer and format
        base = _load(base_spec)
        source = next(s for s in spec.entry.sources if s.base)
        model, where = derive(spec.entry, source, base.model)
        tokenizer, codes = base.tokenizer, None
        detail = describe_weights(spec.weights) if own_layers(source) else base.weights_detail
    else:
        found = read(spec)
        model, tokenizer, where, codes = found.model, found.tokenizer, found.source, found.codes
        detail = describe_weights(spec.weights, found.codes_note)
    model = apply_format(model, spec.weights, codes)
    plan = tune(model)
    name, chat = described(spec, tokenizer)
    loaded = LoadedModel(
        name,
        model,
        tokenizer,
        chat,
        eos_ids(model.generation_config, tokenizer),
        where,
        spec.weights,
        detail,
        linear_path(model, spec.weights, plan),
        plan,
    )
    _loaded[spec] = loaded
    return loaded


def linear_path(model: nn.Module, weights: str, plan: Plan | None) -> str:
    """How the model's linear layers compute, for the records."""
    rows = describe_rows(model)
    rows = f"; {rows}" if rows else ""
    described = plan.describe() if plan is not None else None
    if weights != FP32:
        return f"{weights} weight-only kernels; head {described or 'F.linear'}{rows}"
    return (described or "F.linear") + rows


def retuned(loaded: LoadedModel, by: str) -> LoadedModel:
    """`loaded` on the kernel plan recorded last (mtp_viz.kernel_plan, or MTP_VIZ_LINEAR), its row
    plans read or probed on it; the record says so, and later loads get the new record."""
    with load_lock:
        plan = tune(loaded.model, by)
        new = replace(loaded, linear=linear_path(loaded.model, loaded.weights, plan), plan=plan)
        for spec, old in list(_loaded.items()):
            if old.model is loaded.model:
                _loaded[spec] = new
        return new


def heads_for(target: LoadedModel, path: Path) -> MTPHeads:
    """The MTP heads in `path`, loaded once per target, in the target's format on its plan."""
    with load_lock:
        loaded = _heads.setdefault(target.model, {})
        if str(path) not in loaded:
            heads = apply_format(load_heads(target.model, path), target.weights)
            use_fast_linears(heads, target.plan or STOCK_PLAN)
            loaded[str(path)] = heads.eval()
        return loaded[str(path)]


def forget() -> None:
    """Drop every cached load (tests that swap registries or machines)."""
    with load_lock:
        _loaded.clear()
        _heads.clear()
