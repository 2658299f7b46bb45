"""What a strategy costs to deploy, beside what it buys: extra models to serve, extra parameters
and memory (their weights and KV cache at the run's length), training required, and forwards per
token of each model. Computed from the loaded objects a trace names, never typed by hand.
"""

from dataclasses import asdict, dataclass

import pandas as pd
import torch

from mtp_viz.errors import UserError
from mtp_viz.labels import BENCH_COLUMNS, is_peer
from mtp_viz.loading import load_eagle3_for, load_heads_for, load_model, resolve_device
from mtp_viz.loading.drafters import registered
from mtp_viz.registry import load_registry
from mtp_viz.strategies import STRATEGIES, get_strategy
from mtp_viz.strategies.variants import build_strategy_settings, parse_variant
from mtp_viz.theory import break_even, concurrency_speedup
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
    return cost_of(
        trace.model,
        trace.strategy,
        trace.draft_model,
        context=len(trace.prompt_token_ids) + len(trace.output_token_ids),
        per_token=(s["target_forwards"] / tokens, s["draft_forwards"] / tokens),
        device=trace.device.split(":")[0],
        dtype=trace.dtype,
    )


def cost_of(
    model: str,
    strategy: str,
    extra: str | None,
    context: int,
    per_token: tuple[float, float],
    device: str | None = None,
    dtype: str | None = None,
) -> DeployCost:
    """What running `strategy` on registered `model` adds, with `extra` the draft model or heads it
    used (a trace's draft_model) and the draft's KV cache at `context` tokens."""
    target = load_model(model, device, dtype)
    extra_models, params, memory, training = 0, [], 0, "none"
    if strategy == "speculative" and extra:
        draft = load_model(extra, device, dtype)
        params = own_parameters(draft.model, target.model)
        memory = kv_cache_bytes(draft.model, context)
        extra_models = 1
        entry = load_registry().models.get(extra)
        trained = entry is not None and any(src.kind == "trained_draft" for src in entry.sources)
        training = "a draft distilled from the target" if trained else "none (an off-the-shelf smaller model)"
    elif base := mask_base(model):  # a mask-token view: its adapter and mask row are extra
        params = own_parameters(target.model, load_model(base, device, dtype).model)
        training = "a mask-token LoRA adapter, self-distilled from the model"
    elif strategy in ("mtp_heads", "conf_adapt") and extra:
        _, heads = load_heads_for(target, extra)
        params = own_parameters(heads, target.model)
        training = "MTP heads, self-distilled from the target"
    elif strategy == "eagle" and extra:
        _, drafter = load_eagle3_for(target, extra)
        params = own_parameters(drafter, target.model)
        c = drafter.config  # its one layer's KV cache
        memory = 2 * c.num_key_value_heads * c.head_dim * context * drafter.dtype.itemsize
        extra_models = 1
        training = "an EAGLE-3 drafter, self-distilled from the target with training-time test"
    weights = sum(p.numel() * p.element_size() for p in params)
    return DeployCost(
        extra_models=extra_models,
        extra_params=sum(p.numel() for p in params),
        extra_memory_mb=round((weights + memory) / MB, 3),
        training=training,
        target_forwards_per_token=round(per_token[0], 4),
        draft_forwards_per_token=round(per_token[1], 4),
    )


def label_cost(model: str, label: str, row: pd.Series, context: int) -> DeployCost:
    """The cost of a bench label ("conf_adapt:tau=0.9") on registered `model`, resolving its draft,
    heads or mask-token model as a run would, and its forwards per token from the summary row."""
    name, values = parse_variant(label)
    spec = get_strategy(name)
    settings = build_strategy_settings(name, values, resolve_device(None).type)
    target, extra = registered(model, spec.drafters(settings))
    tokens = float(row.get("mean_accepted_tokens") or 1.0)
    drafts = row.get("draft_forwards_per_forward")
    per_token = (1.0 / tokens, (0.0 if drafts is None or pd.isna(drafts) else float(drafts)) / tokens)
    return cost_of(target, name, extra, context, per_token)


def mask_base(model_id: str) -> str | None:
    """The base model a registered mask-token adapter model is a view of, or None."""
    entry = load_registry().models.get(model_id)
    sources = entry.sources if entry else ()
    return next((src.base for src in sources if src.kind == "mask_adapter"), None)


def deploy_costs(traces: list[Trace]) -> list[DeployCost | None]:
    """Each trace's cost, or None where its models cannot be loaded here (e.g. an uploaded trace)."""
    costs = []
    for t in traces:
        try:
            costs.append(deploy_cost(t))
        except (UserError, OSError):
            costs.append(None)
    return costs


# What the Deploy view puts side by side, per strategy: the bench table's measured columns, then the costs.
MEASURED = BENCH_COLUMNS
COSTS = ("extra_models", "extra_params", "extra_memory_mb", "training", "target_forwards_per_token")
COSTS += ("draft_forwards_per_token",)
DEPLOY_CONTEXT = 1024  # tokens of context at which the Deploy view counts a draft's KV cache
# A lossy variant is ranked by speed only if it keeps this share of autoregressive's tokens
# (the bench's `agreement`); below it, it is listed last and marked. The user can change it.
DEFAULT_QUALITY_FLOOR = 0.9
QUALITY = "agreement"
LOSSLESS, ABOVE_FLOOR, BELOW_FLOOR = "lossless", "lossy, above the floor", "lossy, BELOW the quality floor"


def quality_class(label: str, row: pd.Series, floor: float) -> str:
    """Whether a bench label is lossless, or lossy and above / below the quality floor."""
    name, values = parse_variant(label)
    if STRATEGIES[name].is_lossless(values):
        return LOSSLESS
    quality = row.get(QUALITY)
    return ABOVE_FLOOR if quality is not None and not pd.isna(quality) and quality >= floor else BELOW_FLOOR


def deploy_table(
    summary: pd.DataFrame, model: str, context: int = DEPLOY_CONTEXT, floor: float = DEFAULT_QUALITY_FLOOR
) -> pd.DataFrame:
    """One row per strategy of a bench summary on `model` (transformers' peers left out: they are
    baselines, not deployments): what it measured (speed, quality) beside what it costs to deploy,
    from the models a run of it loads here (blank where they cannot be loaded). Ranked by speed
    among the strategies that are lossless or keep the quality floor; the rest follow, marked."""
    overall = summary[(summary["category"] == "overall") & ~summary["strategy"].map(is_peer)]
    rows = []
    for _, row in overall.iterrows():
        label = str(row["strategy"])
        record = {"strategy": label, "quality": quality_class(label, row, floor)}
        for column, key in MEASURED.items():
            record[column] = row.get(key, float("nan"))
        try:
            cost = label_cost(model, label, row, context)
        except (UserError, OSError):
            cost = None
        for key in COSTS:
            record[key] = getattr(cost, key) if cost is not None else None
        rows.append(record)
    table = pd.DataFrame(rows, columns=["strategy", "quality", *MEASURED, *COSTS])
    table["_below"] = table["quality"] == BELOW_FLOOR
    table = table.sort_values(["_below", "speedup"], ascending=[True, False]).drop(columns="_below")
    return table.reset_index(drop=True)  # as measured: the views round what a person reads (mtp_viz.ui.readable)


def within_floor(summary: pd.DataFrame, floor: float = DEFAULT_QUALITY_FLOOR) -> pd.DataFrame:
    """The summary's rows of strategies that are lossless or keep the quality floor (overall),
    and of transformers' peers."""
    overall = summary[summary["category"] == "overall"]
    keep = {
        str(row["strategy"])
        for _, row in overall.iterrows()
        if is_peer(row["strategy"]) or quality_class(str(row["strategy"]), row, floor) != BELOW_FLOOR
    }
    return summary[summary["strategy"].astype(str).isin(keep)]


def concurrency_curves(
    summary: pd.DataFrame,
    strategies: list[str],
    batch_cost: dict[int, dict[int, float]],
    c: float | dict[str, dict[int, float]] | None,
) -> dict[str, tuple[dict[int, float], int | None]]:
    """label → (B → predicted speedup with B concurrent users, the first B below 1x), for the
    strategies whose summary has the per-forward figures (older summaries lack them); c: one draft
    cost ratio, or a serving engine's per strategy and B (mtp_viz.profile.ProfileView.draft_costs)."""
    overall = summary[summary["category"] == "overall"].set_index("strategy")
    curves = {}
    for label in strategies:
        if label not in overall.index or "scored_per_forward" not in overall:
            continue
        row = overall.loc[label]
        tokens, scored, drafts = (
            row["mean_accepted_tokens"],
            row["scored_per_forward"],
            row["draft_forwards_per_forward"],
        )
        if pd.isna(tokens) or pd.isna(scored):
            continue
        cost = c.get(label.partition(":")[0]) if isinstance(c, dict) else c  # a serving engine's: per strategy
        if drafts and cost is None:
            continue  # a draft model's cost is unknown without c
        speedups = concurrency_speedup(float(tokens), float(scored), float(drafts or 0.0), cost or 0.0, batch_cost)
        curves[label] = (speedups, break_even(speedups))
    return curves
