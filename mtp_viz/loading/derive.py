"""Derive: models made from a loaded base, sharing its modules (no second copy of its weights):
an early-exit view, a trained draft that borrows the base's embedding and head, a mask-token
adapter. Each comes back as a plain model; the pipeline applies the base's format and kernels."""

from pathlib import Path

import torch
from transformers import PreTrainedModel

from mtp_viz.drafters.draft import load_draft
from mtp_viz.drafters.mask import load_mask_model
from mtp_viz.errors import UserError
from mtp_viz.registry import ModelEntry, Source


def derive(entry: ModelEntry, source: Source, base: PreTrainedModel) -> tuple[PreTrainedModel, str]:
    """The model `source` derives from `base`, and where it came from (for the trace)."""
    if source.kind == "early_exit":
        return early_exit_view(base, source.layers), f"{source.kind}:{source.base}[:{source.layers}]"
    if source.kind == "trained_draft":
        return load_draft(base, Path(source.path)), f"{source.kind}:{source.path}"
    if source.kind == "mask_adapter":
        model = load_mask_model(base, Path(source.path))
        if model.mtp_mask_spec.mask_token_id != entry.mask_token_id:
            raise UserError(
                f"model {entry.id}: models.yaml says mask_token_id {entry.mask_token_id}, "
                f"the adapter in {source.path} uses {model.mtp_mask_spec.mask_token_id}"
            )
        return model, f"{source.kind}:{source.path}"
    raise AssertionError(source.kind)


def own_layers(source: Source) -> bool:
    """Whether a derived model's layers hold weights of its own (a trained draft's, which a weight
    format quantizes here), not its base's modules (a view, an adapter on them)."""
    return source.kind == "trained_draft"


def early_exit_view(model: PreTrainedModel, layers: int) -> PreTrainedModel:
    """A model made of the first `layers` decoder layers of `model`, then its final norm and head.

    The modules are shared, not copied: the view costs no memory, and it keeps its own KV cache
    when a strategy wraps it in a CachedModel. Untrained, so it agrees with the full model only
    sometimes; that is what makes it a teaching draft (trained drafters replace it).
    """
    config = model.config.__class__.from_dict(model.config.to_dict())
    if not 1 <= layers < config.num_hidden_layers:
        raise UserError(f"an early exit needs 1 to {config.num_hidden_layers - 1} layers, got {layers}")
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    with torch.device("meta"):
        view = type(model)(config)
    view.model.embed_tokens = model.model.embed_tokens
    view.model.layers = torch.nn.ModuleList(model.model.layers[:layers])
    view.model.norm = model.model.norm
    view.model.rotary_emb = model.model.rotary_emb
    view.lm_head = model.lm_head
    view.generation_config = model.generation_config
    return view.eval()
