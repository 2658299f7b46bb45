"""EAGLE-3 drafters for a loaded target: which one a run uses (a registry id, a checkpoint
folder, or the target's first registered), where its checkpoint lies (a hub repo is fetched once,
when reachable), and the drafter itself, checked against the target and sharing its embedding,
run as the target runs: in its weight format and on its linear plan, q|k|v and gate|up fused."""

from pathlib import Path
from weakref import WeakKeyDictionary

import torch
from torch import nn

from mtp_viz import native
from mtp_viz.drafters.eagle3 import Eagle3Drafter, fuse_products, load_eagle3
from mtp_viz.errors import UserError
from mtp_viz.kernels import STOCK_PLAN, replace_module, use_fast_linears
from mtp_viz.loading.loaded import LoadedModel
from mtp_viz.loading.pipeline import load_lock
from mtp_viz.loading.sources import hub_reachable
from mtp_viz.registry import Eagle3Entry, load_registry
from mtp_viz.weights import FP32, GROUP, Q4, Q8, FormatLinear, convert, head_format

TRAIN_EAGLE3 = "python -m mtp_viz train eagle"
EAGLE3_FILES = ("config.json", "*.safetensors", "*.bin")  # what a hub checkpoint's download fetches
BLOCK_FORMATS = (Q4, Q8)  # formats that hold a row's weights in blocks of GROUP
TORCH_INT4_OUTPUTS = 16  # torch's int4 CPU kernel packs outputs in sixteens (ours takes any count)


def load_eagle3_for(target: LoadedModel, eagle3: str | None = None) -> tuple[str, Eagle3Drafter]:
    """The named EAGLE-3 drafter (registry id or a checkpoint directory), or the target's first
    registered one, on the target's device, sharing its token embedding (cached per target)."""
    entry = eagle3_entry(target.name, eagle3)
    with load_lock:
        drafters = _loaded.setdefault(target.model, {})
        if entry not in drafters:
            drafters[entry] = _load(target, entry)
        return entry.id, drafters[entry]


def eagle3_entry(target: str, eagle3: str | None = None) -> Eagle3Entry:
    """Which EAGLE-3 drafter a run of model `target` uses: `eagle3` (a registry id or a checkpoint
    directory), or the target's first registered one."""
    registry = load_registry()
    if eagle3 is None:
        entry = registry.models.get(target)
        if entry is None or not entry.eagle3:
            raise UserError(f"no EAGLE-3 drafter registered for {target}; train one with {TRAIN_EAGLE3}")
        eagle3 = entry.eagle3[0]
    if eagle3 in registry.eagle3:
        drafter = registry.get_eagle3(eagle3)
        if drafter.base != target:
            raise UserError(f"EAGLE-3 drafter {eagle3} was trained for {drafter.base}, not {target}")
        return drafter
    if Path(eagle3).is_dir():
        return Eagle3Entry(eagle3, eagle3, target, path=eagle3)
    registry.get_eagle3(eagle3)  # raises with the list of known drafters
    raise AssertionError("unreachable")


def eagle3_dir(entry: Eagle3Entry) -> Path:
    """Where a registered drafter's checkpoint lies (a hub repo is downloaded once, when reachable)."""
    if entry.repo is not None:
        if not hub_reachable():
            raise UserError(f"EAGLE-3 drafter {entry.id} lives on the Hugging Face Hub ({entry.repo}), not reachable")
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(entry.repo, allow_patterns=list(EAGLE3_FILES)))
    path = Path(entry.path)
    if not (path / "config.json").is_file():
        raise UserError(
            f"EAGLE-3 drafter {entry.id} is registered at {path}, which holds no checkpoint yet; "
            f"train it with {TRAIN_EAGLE3}"
        )
    return path


_loaded: WeakKeyDictionary = WeakKeyDictionary()  # the target's model → {entry: its drafter}


def _load(target: LoadedModel, entry: Eagle3Entry) -> Eagle3Drafter:
    embed = target.model.get_input_embeddings()
    layers = target.model.config.num_hidden_layers
    dtype = target.model.dtype if target.device.type != "cpu" else torch.float32  # the target's float dtype on GPU
    drafter = load_eagle3(eagle3_dir(entry), embed=embed, target_layers=layers, dtype=dtype)
    c, (vocab, hidden) = drafter.config, embed.weight.shape
    problems = []
    if c.vocab_size != vocab:
        problems.append(f"vocabulary {c.vocab_size} (the target's: {vocab})")
    if (c.target_hidden_size or c.hidden_size) != hidden:
        problems.append(f"target hidden size {c.target_hidden_size or c.hidden_size} (the target's: {hidden})")
    if not drafter.owns_embedding and c.hidden_size != hidden:
        problems.append(f"hidden size {c.hidden_size} without its own embedding (the target's: {hidden})")
    if not all(0 <= i <= layers for i in c.aux_layer_ids):
        problems.append(f"aux layers {list(c.aux_layer_ids)} (the target has {layers})")
    if problems:
        raise UserError(f"EAGLE-3 drafter {entry.id} does not fit {target.name}: {'; '.join(problems)}")
    return on_targets_path(drafter.to(target.device), target)


def on_targets_path(drafter: Eagle3Drafter, target: LoadedModel) -> Eagle3Drafter:
    """The drafter as its target runs: each linear in the target's weight format (its head in the
    format of the target's head) where the linear's shape allows it (`misfit`: else it stays float32),
    the float32 ones on the target's linear plan, then q|k|v and gate|up fused."""
    for _, parent, name, linear in _plain_linears(drafter):
        fmt = _format_for(drafter, linear, target.weights)
        if fmt != FP32 and misfit(linear, fmt) is None:
            replace_module(parent, name, convert(linear, fmt))
    use_fast_linears(drafter, target.plan or STOCK_PLAN)
    fuse_products(drafter)
    return drafter


def misfit(linear: nn.Linear, fmt: str) -> str | None:
    """Why `linear` cannot hold its weights in `fmt`, or None when it can."""
    if fmt in BLOCK_FORMATS and linear.in_features % GROUP:
        return f"{linear.in_features} inputs, not a multiple of {GROUP}"
    if fmt == Q4 and not native.available() and linear.out_features % TORCH_INT4_OUTPUTS:
        return f"{linear.out_features} outputs, not a multiple of {TORCH_INT4_OUTPUTS} (torch's int4 kernel)"
    return None


def eagle3_weights(drafter: Eagle3Drafter, fmt: str) -> str:
    """How the drafter's products run, for the records, read from its modules' types: "q4 (head q8;
    q|k|v, gate|up fused)", naming each linear left in float32 in a target's format `fmt`, and why."""
    head = drafter.lm_head
    parts = [f"head {head.fmt if isinstance(head, FormatLinear) else FP32}"]
    for name, _, _, linear in _plain_linears(drafter):
        if why := misfit(linear, _format_for(drafter, linear, fmt)):
            parts.append(f"{name} fp32: {why}")
    parts.append("q|k|v, gate|up fused" if drafter.midlayer.fused is not None else "q|k|v, gate|up apart")
    return f"{fmt} ({'; '.join(parts)})"


def _format_for(drafter: Eagle3Drafter, linear: nn.Module, fmt: str) -> str:
    """The format a linear of the drafter takes when its target's layers are in `fmt`."""
    return head_format(fmt) if linear is drafter.lm_head else fmt


def _plain_linears(drafter: Eagle3Drafter) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """(its name in the drafter, parent, its name in the parent, linear) of each linear holding
    float32 weights (in no format)."""
    return [
        (f"{prefix}.{name}" if prefix else name, parent, name, child)
        for prefix, parent in drafter.named_modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and not isinstance(child, FormatLinear)
    ]
