"""A small draft model for a frozen target: a few decoder layers of the target's own architecture,
started from chosen target layers and distilled from the target's predictions.

It shares the target's input embedding and rotary tables (the same modules, no copy) and scores a
reduced vocabulary with the target's head rows, so a draft forward costs a few layers plus a
narrow projection. Only its layers and final norm are trained and shipped (fp16 safetensors,
with the reduced vocabulary's ids); `load_draft` rebuilds the rest from the target.
"""

import copy
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from mtp_viz.drafters.vocab import ReducedHead
from mtp_viz.errors import UserError

SPEC_FILE = "draft.json"
WEIGHTS_FILE = "weights.safetensors"


@dataclass(frozen=True)
class DraftSpec:
    base: str  # registry id of the target it was trained for
    init_layers: tuple[int, ...]  # the target layers its layers started from
    hidden_size: int
    vocab_size: int  # the target's full vocabulary
    reduced_vocab: int


def build_draft(
    target: PreTrainedModel, init_layers: tuple[int, ...], vocab_ids: torch.Tensor, copy_layers: bool = True
) -> PreTrainedModel:
    """A draft whose layer j starts as a copy of target layer init_layers[j] (unless not
    `copy_layers`: a trained draft's layers are loaded from its file, and a target in a weight
    format other than fp32 has no float weights to copy)."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(init_layers)
    config.tie_word_embeddings = False
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in init_layers]
    with torch.device("meta"):
        draft = type(target)(config)
    layer_cls = type(target.model.layers[0])
    layers = []
    for j, i in enumerate(init_layers):
        layer = layer_cls(config, j).to(device=target.device, dtype=target.dtype)  # j: its index in the cache
        if copy_layers:
            layer.load_state_dict(target.model.layers[i].state_dict())
        layers.append(layer)
    draft.model.layers = torch.nn.ModuleList(layers)
    draft.model.embed_tokens = target.model.embed_tokens  # shared, frozen
    draft.model.rotary_emb = target.model.rotary_emb
    draft.model.norm = copy.deepcopy(target.model.norm)
    draft.lm_head = ReducedHead(target.lm_head.weight, vocab_ids.to(target.device), config.vocab_size)
    draft.generation_config = copy.deepcopy(target.generation_config)  # transformers may edit an assistant's
    draft.model.embed_tokens.weight.requires_grad_(False)
    return draft.eval()


def trained_parameters(draft: PreTrainedModel) -> dict[str, torch.nn.Parameter]:
    """What training updates and what ships: the layers and the final norm."""
    return {n: p for n, p in draft.named_parameters() if n.startswith(("model.layers.", "model.norm."))}


def save_draft(draft: PreTrainedModel, spec: DraftSpec, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    tensors = {n: p.detach().to("cpu", torch.float16).contiguous() for n, p in trained_parameters(draft).items()}
    tensors["vocab_ids"] = draft.lm_head.ids.to("cpu", torch.int32)
    save_file(tensors, path / WEIGHTS_FILE)
    (path / SPEC_FILE).write_text(json.dumps(asdict(spec), indent=1))


def read_spec(path: Path) -> DraftSpec:
    data = json.loads((path / SPEC_FILE).read_text())
    return DraftSpec(**{**data, "init_layers": tuple(data["init_layers"])})


def load_draft(target: PreTrainedModel, path: Path) -> PreTrainedModel:
    """Rebuild a saved draft around `target` (its embedding and head rows) and load its weights."""
    if not (path / SPEC_FILE).is_file():
        raise UserError(f"{path} holds no trained draft ({SPEC_FILE} missing)")
    spec = read_spec(path)
    if (spec.hidden_size, spec.vocab_size) != (target.config.hidden_size, target.config.vocab_size):
        raise UserError(f"draft in {path} was trained for another target ({spec.base})")
    tensors = load_file(path / WEIGHTS_FILE)
    draft = build_draft(target, spec.init_layers, tensors.pop("vocab_ids").long(), copy_layers=False)
    params = trained_parameters(draft)
    with torch.no_grad():
        for name, value in tensors.items():
            params[name].copy_(value.to(params[name].dtype))
    return draft
