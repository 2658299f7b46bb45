"""The first step of every load: what is asked for, resolved. A model name (a registry id, a local
model directory, a hub id, or None for the device's default), a device and a dtype ("auto" or
None: the device's) become a `LoadSpec` that names exactly one model in one place; the weight
format is settled above this step (mtp_viz.loading.resolve), so a spec never says `auto`.

The one place that knows the default model is `model_name`."""

from dataclasses import dataclass

import torch

from mtp_viz.errors import UserError
from mtp_viz.registry import ModelEntry, load_registry
from mtp_viz.weights import FP32, check_format

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadSpec:
    """One model to load: its name, its registry entry (None for a directory or a hub id; part of
    the key, so two registries that name different models alike never share a load), where, in
    which dtype and weight format."""

    name: str
    entry: ModelEntry | None
    device: str  # "cpu", "cuda", "cuda:1"
    dtype: str  # a key of DTYPES
    weights: str = FP32  # a concrete format of mtp_viz.weights, never auto

    def __post_init__(self):
        check_format(self.weights, self.device)  # a format this device runs: a clear error before any load

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def base(self) -> "LoadSpec | None":
        """The spec of the model this one is derived from (a draft, a view or an adapter shares its
        base's modules, so it loads in the base's device, dtype and format), or None."""
        source = next((s for s in self.entry.sources if s.base), None) if self.entry else None
        if source is None:
            return None
        return LoadSpec(source.base, load_registry().get(source.base), self.device, self.dtype, self.weights)

    @property
    def root(self) -> "LoadSpec":
        """The model at the bottom of the derivation chain: the one whose weights are read."""
        base = self.base
        return self if base is None else base.root


def resolve_device(device: str | None = None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise UserError(f"unknown device {device!r}; use auto, cpu or cuda") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise UserError("device cuda was asked for but no CUDA device is available")
    return resolved


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; use auto or one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def model_name(model: str | None, device: str | None = None) -> str:
    """The model a run uses: `model` as named, or the registry's default for the device (`device`
    as a user gives it: None or auto for this machine's best, or a device type)."""
    return model or load_registry().default_for(resolve_device(device).type)


def load_spec(name: str | None, device: str | None = None, dtype: str | None = None, weights: str = FP32) -> LoadSpec:
    """A name, device and dtype as a user gives them → the spec (`weights` already concrete)."""
    dev = resolve_device(device)
    dt = str(resolve_dtype(dtype, dev)).removeprefix("torch.")
    name = model_name(name, str(dev))
    return LoadSpec(name, load_registry().models.get(name), str(dev), dt, weights)
