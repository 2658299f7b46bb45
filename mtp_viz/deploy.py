"""What a strategy costs to deploy, beside what it buys: extra models to serve, extra parameters
and memory (their weights and KV cache at the run's length), training required, and forwards per
token of each model. Computed from the loaded objects a trace names, never typed by hand.
"""

from dataclasses import asdict, dataclass

import torch

from mtp_viz.errors import UserError
from mtp_viz.models import load_heads_for, load_model
from mtp_viz.registry import load_registry
from mtp_viz.trace import Trace

MB = 2**20


@dataclass(frozen=True)
class DeployCost:
    extra_models: int  # networks to serve beside the target (a draft model)
    extra_params: int  # parameters beyond the target's own (shared ones not counted)
    extra_memory_mb: float  # those parameters, plus the draft's KV cache at the run's length
    training: str  # what has to be trained before the strategy can run
    target_forwards_per_token: float
    draft_forwards_per_token: float

    def as_dict(self) -> dict:
        return asdict(self)


def own_parameters(module: torch.nn.Module, shared_with: torch.nn.Module) -> list[torch.Tensor]:
    """`module`'s parameters that `shared_with` does not hold (the same memory), each once."""
    shared = {(p.data_ptr(), p.shape) for p in shared_with.parameters()}
    seen, own = set(), []
    for p in module.parameters():
        ptr = (p.data_ptr(), p.shape)  # fused projections are views of one storage: compare the views
        if ptr not in shared and ptr not in seen:
            seen.add(ptr)
            own.append(p)
    return own


def kv_cache_bytes(model: torch.nn.Module, tokens: int) -> int:
    """Bytes of a KV cache of `tokens` positions for a decoder model (all layers, keys and values)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    return config.num_hidden_layers * 2 * kv_heads * head_dim * tokens * itemsize


def deploy_cost(trace: Trace) -> DeployCost:
    """The deployment cost of the run a trace records, from the models it names (loaded, cached)."""
    s = trace.summary
    tokens = max(1, s["new_tokens"])
    per_token = (s["target_forwards"] / tokens, s["draft_forwards"] / tokens)
    device, dtype = trace.device.split(":")[0], trace.dtype
    target = load_model(trace.model, device, dtype)
    extra_models, params, memory, training = 0, [], 0, "none"
    if trace.strategy == "speculative" and trace.draft_model:
        draft = load_model(trace.draft_model, device, dtype)
        params = own_parameters(draft.model, target.model)
        memory = kv_cache_bytes(draft.model, len(trace.prompt_token_ids) + len(trace.output_token_ids))
        extra_models = 1
        entry = load_registry().models.get(trace.draft_model)
        trained = entry is not None and any(src.kind == "trained_draft" for src in entry.sources)
        training = "a draft distilled from the target" if trained else "none (an off-the-shelf smaller model)"
    elif trace.strategy in ("mtp_heads", "conf_adapt") and trace.draft_model:
        _, heads = load_heads_for(target, trace.draft_model)
        params = own_parameters(heads, target.model)
        training = "MTP heads, self-distilled from the target"
    weights = sum(p.numel() * p.element_size() for p in params)
    return DeployCost(
        extra_models=extra_models,
        extra_params=sum(p.numel() for p in params),
        extra_memory_mb=round((weights + memory) / MB, 3),
        training=training,
        target_forwards_per_token=round(per_token[0], 4),
        draft_forwards_per_token=round(per_token[1], 4),
    )


def deploy_costs(traces: list[Trace]) -> list[DeployCost | None]:
    """Each trace's cost, or None where its models cannot be loaded here (e.g. an uploaded trace)."""
    costs = []
    for t in traces:
        try:
            costs.append(deploy_cost(t))
        except (UserError, OSError):
            costs.append(None)
    return costs
