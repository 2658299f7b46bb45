"""models.yaml → validated registry entries; the default model for a device."""

import os
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import yaml

from mtp_viz.drafters.kinds import DrafterKind
from mtp_viz.errors import UnknownModelError

REGISTRY_ENV = "MTP_VIZ_MODELS"  # path of another models.yaml (tests point it at tiny models)
DEFAULT_REGISTRY = Path(__file__).resolve().parent.parent / "models.yaml"
SOURCE_KINDS = ("cache", "hub", "gguf_wheel", "local", "early_exit", "trained_draft", "mask_adapter")


@dataclass(frozen=True)
class Source:
    kind: str
    repo: str | None = None  # hub
    package: str | None = None  # gguf_wheel
    file: str | None = None  # gguf_wheel
    path: str | None = None  # local, trained_draft, mask_adapter
    base: str | None = None  # early_exit, trained_draft, mask_adapter: the registry id whose modules it shares
    layers: int | None = None  # early_exit


@dataclass(frozen=True)
class ModelEntry:
    id: str
    label: str
    sources: tuple[Source, ...]
    chat: bool = True
    drafts: tuple[str, ...] = ()
    heads: tuple[str, ...] = ()  # MTP heads trained for this model, best first
    mask_token_id: int | None = None  # mask-token MTP models (ConfAdapt): the id of their mask token
    mask_model: str | None = None  # this model's mask-token MTP model (a registry id), for mask strategies
    eagle3: tuple[str, ...] = ()  # EAGLE-3 drafters for this model, best first

    def drafters(self, kind: DrafterKind) -> tuple[str, ...]:
        """The registered drafters of one kind, best first (masks: the mask-token model, or this
        model itself where it has a mask token)."""
        if kind == DrafterKind.MASKS:
            return (self.mask_model or self.id,) if self.mask_model or self.mask_token_id is not None else ()
        by_kind = {DrafterKind.DRAFT_MODEL: self.drafts, DrafterKind.HEADS: self.heads, DrafterKind.EAGLE3: self.eagle3}
        return by_kind[kind]


@dataclass(frozen=True)
class HeadsEntry:
    """Trained MTP heads (mtp_viz.drafters.heads) for one registered base model."""

    id: str
    label: str
    base: str
    path: str


@dataclass(frozen=True)
class Eagle3Entry:
    """An EAGLE-3 drafter (mtp_viz.drafters.eagle3) for one registered base model: a checkpoint
    directory (`path`, resolved against models.yaml's folder; it may not exist yet) or a Hugging
    Face Hub repo (`repo`, fetched on first use when the hub is reachable)."""

    id: str
    label: str
    base: str
    path: str | None = None
    repo: str | None = None

    @property
    def where(self) -> str:
        return self.path or f"hub:{self.repo}"


@dataclass(frozen=True)
class Registry:
    models: dict[str, ModelEntry]
    defaults: dict[str, str]  # device type → model id
    heads: dict[str, HeadsEntry] = field(default_factory=dict)
    eagle3: dict[str, Eagle3Entry] = field(default_factory=dict)

    def get_eagle3(self, eagle3_id: str) -> Eagle3Entry:
        try:
            return self.eagle3[eagle3_id]
        except KeyError:
            known = ", ".join(self.eagle3) or "none"
            raise UnknownModelError(f"unknown EAGLE-3 drafter {eagle3_id!r} (registered: {known})") from None

    def get_heads(self, heads_id: str) -> HeadsEntry:
        try:
            return self.heads[heads_id]
        except KeyError:
            known = ", ".join(self.heads) or "none"
            raise UnknownModelError(f"unknown heads {heads_id!r} (registered: {known})") from None

    def get(self, model_id: str) -> ModelEntry:
        try:
            return self.models[model_id]
        except KeyError:
            raise UnknownModelError(
                f"unknown model {model_id!r}: not in the registry ({', '.join(self.models)}) "
                "and not a local model directory"
            ) from None

    def default_for(self, device_type: str) -> str:
        return self.defaults.get(device_type) or self.defaults["cpu"]


def parse_registry(data: dict, base_dir: Path) -> Registry:
    models = {}
    for raw in data["models"]:
        sources = []
        for s in raw["sources"]:
            if s["kind"] not in SOURCE_KINDS:
                raise ValueError(f"model {raw['id']}: unknown source kind {s['kind']!r}")
            if s.get("path"):
                s = {**s, "path": str((base_dir / s["path"]).resolve())}
            sources.append(Source(**s))
        entry = ModelEntry(
            id=raw["id"],
            label=raw.get("label", raw["id"]),
            sources=tuple(sources),
            chat=bool(raw.get("chat", True)),
            drafts=tuple(raw.get("drafts", ())),
            heads=tuple(raw.get("heads", ())),
            mask_token_id=raw.get("mask_token_id"),
            mask_model=raw.get("mask_model"),
            eagle3=tuple(raw.get("eagle3", ())),
        )
        models[entry.id] = entry
    heads = {}
    for raw in data.get("heads", ()):
        h = HeadsEntry(raw["id"], raw.get("label", raw["id"]), raw["base"], str((base_dir / raw["path"]).resolve()))
        if h.base not in models:
            raise ValueError(f"heads {h.id}: base {h.base!r} is not in the registry")
        heads[h.id] = h
    eagle3 = {e.id: e for e in (_eagle3_entry(raw, models, base_dir) for raw in data.get("eagle3", ()))}
    for entry in models.values():
        for s in entry.sources:
            if s.kind == "early_exit" and (s.base not in models or not s.layers):
                raise ValueError(f"model {entry.id}: early_exit needs a registered base and a layer count")
            if s.kind in ("trained_draft", "mask_adapter") and (s.base not in models or not s.path):
                raise ValueError(f"model {entry.id}: {s.kind} needs a registered base and a path")
            if s.kind == "mask_adapter" and entry.mask_token_id is None:
                raise ValueError(f"model {entry.id}: a mask_adapter model needs its mask_token_id")
        if entry.mask_model is not None and (
            entry.mask_model not in models or models[entry.mask_model].mask_token_id is None
        ):
            raise ValueError(f"model {entry.id}: mask_model {entry.mask_model!r} is not a registered mask-token model")
        for h in entry.heads:
            if h not in heads:
                raise ValueError(f"model {entry.id}: heads {h!r} are not in the registry")
        for e in entry.eagle3:
            if e not in eagle3:
                raise ValueError(f"model {entry.id}: EAGLE-3 drafter {e!r} is not in the registry's eagle3 list")
            if eagle3[e].base != entry.id:
                raise ValueError(f"model {entry.id}: EAGLE-3 drafter {e!r} is registered for {eagle3[e].base}")
        for d in entry.drafts:
            if d not in models:
                raise ValueError(f"model {entry.id}: draft {d!r} is not in the registry")
    defaults = dict(data["defaults"])
    for device, model_id in defaults.items():
        if model_id not in models:
            raise ValueError(f"default for {device}: {model_id!r} is not in the registry")
    return Registry(models, defaults, heads, eagle3)


def _eagle3_entry(raw: dict, models: dict[str, ModelEntry], base_dir: Path) -> Eagle3Entry:
    name = raw.get("id")
    if not name or not raw.get("base"):
        raise ValueError(f"eagle3 entry {raw!r}: needs an id and a base")
    if raw["base"] not in models:
        raise ValueError(f"eagle3 {name}: base {raw['base']!r} is not in the registry")
    if bool(raw.get("path")) == bool(raw.get("repo")):
        given = "both a path and a repo" if raw.get("path") else "neither a path nor a repo"
        raise ValueError(f"eagle3 {name}: {given}; give one (a checkpoint directory, or a hub repo id)")
    path = str((base_dir / raw["path"]).resolve()) if raw.get("path") else None
    return Eagle3Entry(name, raw.get("label", name), raw["base"], path, raw.get("repo"))


@cache
def _load(path: str) -> Registry:
    p = Path(path)
    return parse_registry(yaml.safe_load(p.read_text(encoding="utf-8")), p.parent)


def load_registry() -> Registry:
    return _load(os.environ.get(REGISTRY_ENV, str(DEFAULT_REGISTRY)))
