"""What a strategy drafts with, loaded against its target: each drafter kind
(mtp_viz.drafters.kinds) knows which of the target's registered drafters a run uses and loads it
once, in the target's weight format and on its linear plan. The runner asks for the kinds its
strategy names, best first, and gets one `Drafting`, which says what format its drafter runs in."""

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from mtp_viz.drafters.eagle3 import Eagle3Drafter
from mtp_viz.drafters.heads import MTPHeads
from mtp_viz.drafters.kinds import DrafterKind
from mtp_viz.errors import UserError
from mtp_viz.loading.eagle3 import eagle3_weights, load_eagle3_for
from mtp_viz.loading.loaded import LoadedModel
from mtp_viz.loading.pipeline import heads_for
from mtp_viz.loading.resolve import load_model
from mtp_viz.registry import load_registry
from mtp_viz.weights import AUTO, FP32, FormatLinear


@dataclass(frozen=True)
class DrafterRequest:
    """The drafters a run names (None: the target's first registered) and how its models load."""

    strategy: str
    draft: str | None = None
    heads: str | None = None
    eagle3: str | None = None
    device: str | None = None
    dtype: str | None = None
    weights: str = "fp32"


@dataclass(frozen=True)
class Drafting:
    """A target and what drafts for it: at most one of draft, heads, eagle3; or the target is a
    mask-token model (mask_token_id) that drafts itself."""

    target: LoadedModel
    mask_token_id: int | None = None
    name: str | None = None  # the drafter as the trace names it
    draft: LoadedModel | None = None
    heads: MTPHeads | None = None
    eagle3: Eagle3Drafter | None = None
    weights: str | None = None  # the drafter's weight format as the records say it (None: it is the target)


def load_drafting(target: LoadedModel, kinds: tuple[DrafterKind, ...], request: DrafterRequest) -> Drafting:
    """The first of `kinds` this target has, loaded; the last kind's own error when none is
    registered (a mask-token model that lacks a mask token is the strategy's to refuse)."""
    entry = load_registry().models.get(target.name)
    drafting = Drafting(target, mask_token_id=entry.mask_token_id if entry else None)
    for kind in kinds:
        found = LOADERS[kind](drafting, request)
        if found is not None:
            return found
    return drafting


def registered(model: str, kinds: tuple[DrafterKind, ...]) -> tuple[str, str | None]:
    """(the model a run of registered `model` runs on, its drafter's registry id or None), as
    load_drafting picks them with nothing named, without loading anything."""
    entry = load_registry().get(model)
    for kind in kinds:
        found = entry.drafters(kind)
        if kind == DrafterKind.MASKS:
            if found:
                return entry.mask_model or model, None
            continue
        return model, found[0] if found else None
    return model, None


def _draft_model(drafting: Drafting, request: DrafterRequest) -> Drafting:
    name = request.draft
    if name is None:
        entry = load_registry().models.get(drafting.target.name)
        if entry is None or not entry.drafts:
            raise UserError(
                f"strategy {request.strategy} needs a draft model; none is registered for "
                f"{drafting.target.name}, so name one with --draft"
            )
        name = entry.drafts[0]
    # the run's format; `auto` as it was resolved for the target, not chosen anew for the draft alone
    weights = drafting.target.weights if request.weights == AUTO else request.weights
    draft = load_model(name, request.device, request.dtype, weights)
    return replace(drafting, name=draft.name, draft=draft, weights=draft.weights_detail)


def _masks(drafting: Drafting, request: DrafterRequest) -> Drafting | None:
    """The target's mask-token model (the same weights with a mask token and its adapter), or the
    target itself when it is one; None when it has none."""
    if drafting.mask_token_id is not None:
        return drafting
    entry = load_registry().models.get(drafting.target.name)
    if entry is None or not entry.mask_model:
        return None
    target = load_model(entry.mask_model, request.device, request.dtype, request.weights)
    return replace(drafting, target=target, mask_token_id=load_registry().get(entry.mask_model).mask_token_id)


def _heads(drafting: Drafting, request: DrafterRequest) -> Drafting:
    name, heads = load_heads_for(drafting.target, request.heads)
    return replace(drafting, name=name, heads=heads, weights=heads_weights(heads))


def _eagle3(drafting: Drafting, request: DrafterRequest) -> Drafting:
    name, drafter = load_eagle3_for(drafting.target, request.eagle3)
    return replace(drafting, name=name, eagle3=drafter, weights=eagle3_weights(drafter, drafting.target.weights))


LOADERS: dict[DrafterKind, Callable[[Drafting, DrafterRequest], Drafting | None]] = {
    DrafterKind.DRAFT_MODEL: _draft_model,
    DrafterKind.MASKS: _masks,
    DrafterKind.HEADS: _heads,
    DrafterKind.EAGLE3: _eagle3,
}


def load_heads_for(target: LoadedModel, heads: str | None = None) -> tuple[str, MTPHeads]:
    """The named heads (registry id or a directory), or the target's first registered ones."""
    registry = load_registry()
    if heads is None:
        entry = registry.models.get(target.name)
        if entry is None or not entry.heads:
            raise UserError(
                f"no MTP heads are registered for {target.name}; train some (python -m mtp_viz train heads)"
            )
        heads = entry.heads[0]
    if heads in registry.heads:
        entry = registry.get_heads(heads)
        if entry.base != target.name:
            raise UserError(f"heads {heads} were trained for {entry.base}, not {target.name}")
        path = Path(entry.path)
    elif Path(heads).is_dir():
        path = Path(heads)
    else:
        registry.get_heads(heads)  # raises with the list of known heads
        raise AssertionError("unreachable")
    return heads, heads_for(target, path)


def heads_weights(heads: MTPHeads) -> str:
    """ "q4 (head q8)": the format MTP heads' layers and their reduced head compute in, read from
    their modules' types, for the records."""
    product = heads.head.product
    layers = next((m.fmt for m in heads.modules() if isinstance(m, FormatLinear) and m is not product), FP32)
    return f"{layers} (head {product.fmt if product is not None else FP32})"
