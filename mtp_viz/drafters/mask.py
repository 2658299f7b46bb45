"""A mask-token MTP model made from an ordinary one, as "Multi-Token Prediction via Self-Distillation"
(Kirchenbauer et al., arXiv 2602.06019) does: one new `<MTP>` token, whose input embedding is
learned, and a LoRA adapter (peft) trained so that the model's outputs at k−1 mask tokens appended
after the real ones predict the next k−1 tokens after the first.

The mask id is the base vocabulary's size: a new id that is only ever an input (the output head
keeps its rows, so the model never writes it). Gating (`MASK_ONLY`, the default) multiplies the
adapter's output by "is this input a mask" at every position, so real tokens run the untouched
base model: the first prediction of a step is exactly the base model's, and `mask_spec` verifies
with the same model that drafts (no second model). `EVERYWHERE` is plain LoRA, for comparison.

The model is a view: new modules around the base model's own parameter tensors (no second copy of
the weights), so the base model loaded beside it stays as it was.
"""

import copy
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model, set_peft_model_state_dict
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel

from mtp_viz.errors import UserError

SPEC_FILE = "mask_model.json"
WEIGHTS_FILE = "adapter.safetensors"
MASK_ONLY, EVERYWHERE = "mask_only", "everywhere"
GATINGS = (MASK_ONLY, EVERYWHERE)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MASK_VECTOR = "mask_embedding"


@dataclass(frozen=True)
class MaskSpec:
    base: str  # registry id of the model it was trained for
    vocab_size: int  # the base model's; the mask id is this
    hidden_size: int
    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = TARGETS
    gating: str = MASK_ONLY
    trained_k: int = 4  # the largest k (1 + masks) it was trained for

    @property
    def mask_token_id(self) -> int:
        return self.vocab_size


class Gate:
    """Which inputs of the current forward are masks, as a (…, S, 1) float multiplier: set by the
    embedding, read by every adapter layer of the same forward (peft's, through a hook on each
    lora_B; mtp_viz.lean's, which stacks the adapters, directly)."""

    def __init__(self):
        self.value: torch.Tensor | None = None


class MaskEmbedding(nn.Module):
    """The base embedding, with one learned vector for the mask id; records the gate."""

    def __init__(self, embed: nn.Embedding, mask_token_id: int, vector: torch.Tensor, gate: Gate | None):
        super().__init__()
        self.embed = embed
        self.mask_token_id = mask_token_id
        self.vector = nn.Parameter(vector)
        self.gate = gate

    @property
    def weight(self) -> torch.Tensor:  # transformers reads the embedding's weight (device, dtype, tying)
        return self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        is_mask = ids == self.mask_token_id  # (…, S)
        if self.gate is not None:  # mask-only adapters read it
            self.gate.value = is_mask[..., None].to(self.vector.dtype)
        out = self.embed(ids.masked_fill(is_mask, 0))  # (…, S, H)
        return torch.where(is_mask[..., None], self.vector.to(out.dtype), out)


def initial_vector(embed: nn.Embedding, generator: torch.Generator | None = None) -> torch.Tensor:
    """A new row drawn from the existing rows' per-dimension mean and standard deviation (the paper's init)."""
    rows = embed.weight.detach().float()
    noise = torch.randn(rows.shape[1], generator=generator)
    return (rows.mean(0) + rows.std(0) * noise.to(rows.device)).to(embed.weight.dtype)


def shared_view(model: PreTrainedModel) -> PreTrainedModel:
    """New modules around `model`'s own parameters and buffers (no weight is copied)."""
    memo = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return copy.deepcopy(model, memo).eval()


def _gate_output(gate: Gate):
    def hook(_module, _inputs, output):
        return output * gate.value

    return hook


def mask_model(base: PreTrainedModel, spec: MaskSpec, vector: torch.Tensor | None = None) -> PreTrainedModel:
    """A mask-token view of `base` with a fresh (untrained: zero-output) adapter and a mask vector."""
    if spec.gating not in GATINGS:
        raise UserError(f"gating must be one of {', '.join(GATINGS)}, got {spec.gating!r}")
    if (spec.vocab_size, spec.hidden_size) != (base.config.vocab_size, base.config.hidden_size):
        raise UserError(f"this mask-token adapter was made for another model ({spec.base})")
    view = shared_view(base)
    decoder = view.get_decoder()
    gate = Gate()
    embed = decoder.embed_tokens
    vector = initial_vector(embed) if vector is None else vector.to(embed.weight.device, embed.weight.dtype)
    decoder.embed_tokens = MaskEmbedding(embed, spec.mask_token_id, vector, gate if spec.gating == MASK_ONLY else None)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets), lora_dropout=0.0)
    inject_adapter_in_model(config, view)
    if spec.gating == MASK_ONLY:
        for name, module in view.named_modules():
            if name.endswith("lora_B.default"):
                module.register_forward_hook(_gate_output(gate))
    view.mtp_mask_spec = spec
    return view.to(base.device).eval()


def adapter_parameters(view: PreTrainedModel) -> dict[str, nn.Parameter]:
    """What training updates and what ships: the LoRA matrices and the mask vector."""
    params = {n: p for n, p in view.named_parameters() if "lora_" in n}
    params[MASK_VECTOR] = view.get_decoder().embed_tokens.vector
    return params


def save_mask_model(view: PreTrainedModel, path: Path) -> None:
    """In float16 (what ships: half the bytes, and the shipped adapter's held-out scores were the same
    to the last digit as in float32, experiments/mask_adapter_fp16.py); loaded in the base's dtype."""
    path.mkdir(parents=True, exist_ok=True)
    tensors = {n: t.detach().to("cpu", torch.float16).contiguous() for n, t in get_peft_model_state_dict(view).items()}
    tensors[MASK_VECTOR] = view.get_decoder().embed_tokens.vector.detach().to("cpu", torch.float16)
    save_file(tensors, path / WEIGHTS_FILE)
    spec = asdict(view.mtp_mask_spec)
    (path / SPEC_FILE).write_text(json.dumps({**spec, "targets": list(spec["targets"])}, indent=1))


def read_spec(path: Path) -> MaskSpec:
    if not (path / SPEC_FILE).is_file():
        raise UserError(f"{path} holds no mask-token adapter ({SPEC_FILE} missing)")
    raw = json.loads((path / SPEC_FILE).read_text())
    return MaskSpec(**{**raw, "targets": tuple(raw["targets"])})


def load_mask_model(base: PreTrainedModel, path: Path) -> PreTrainedModel:
    """The mask-token view of `base` with the adapter saved in `path`."""
    spec = read_spec(path)
    tensors = load_file(path / WEIGHTS_FILE)
    view = mask_model(base, spec, tensors.pop(MASK_VECTOR))
    result = set_peft_model_state_dict(view, {n: t.to(base.dtype) for n, t in tensors.items()})
    if getattr(result, "unexpected_keys", None):
        raise UserError(f"{path}: adapter weights do not fit the model ({result.unexpected_keys[:3]} …)")
    return view.eval()
