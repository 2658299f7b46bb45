"""Train an EAGLE-3 drafter (mtp_viz.drafters.eagle3) for a frozen target, by self-distillation.

Data: the cached self-distillation set (mtp_viz.training.data): the target's own answers, with
its argmax and top-k view of every position. Features: the target's residual stream after the
drafter's `aux_layer_ids` layers (low, middle, high), computed once per data folder by a
teacher-forced target forward and cached beside the data (fp16).

Training-time test (EAGLE-3, Li et al. 2025): the drafter is unrolled `ttt_steps` times, every
position at once. Step 1 reads (token i+1, fuse(features at i)) at position i, as drafting starts
after each verify; step j reads (token i+j, the drafter's own step j−1 output for the same chain)
at position i+j−1, attending to step 1's entries up to i (the committed prefix, built from the
target's features) and to its own chain's entries of steps 2..j, as the drafter sees its cache
when it drafts. Tokens are the sequence's own (a draft only counts while every earlier draft was
right). Step j of chain i is scored against the target's view of position i+j (the token after
next): cross entropy to its argmax and to its top-k distribution renormalised over the draft
vocabulary, answer positions weighted 1 and prompt positions `prompt_weight`, step j weighted
`step_decay` ** (j − 1).
"""

import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from mtp_viz.drafters.eagle3 import Eagle3Config, Eagle3Drafter, load_eagle3, save_eagle3
from mtp_viz.drafters.eagle3_config import default_aux_layer_ids
from mtp_viz.drafters.vocab import frequent_tokens
from mtp_viz.errors import UserError
from mtp_viz.training.data import Sequence, load_sequences, shards
from mtp_viz.training.draft import batches_of
from mtp_viz.training.features import FeatureStore, is_store, store_sequence
from mtp_viz.training.heldout import PER_CATEGORY, spec_bench_heldout
from mtp_viz.training.loop import LoopConfig, TrainJob, seed_everything

FEATURES = "features"  # the cached target features, per aux-layer choice: data/features/<ids>/<shard>.pt


@dataclass(frozen=True)
class EagleTrainConfig:
    ttt_steps: int = 5  # also the deepest chain the strategy drafts with it (config.json's trained_draft_steps)
    reduced_vocab: int = 8192
    aux_layers: tuple[int, ...] | None = None  # None: vLLM's default (2, L/2, L−3)
    max_tokens: int = 640  # a longer sequence keeps its last max_tokens
    tokens_per_batch: int = 4096  # padded tokens per optimizer step
    step_decay: float = 0.8
    soft_weight: float = 0.5
    prompt_weight: float = 0.2
    holdout_every: int = 20
    heldout_per_category: int = PER_CATEGORY  # Spec-Bench answers scored at every validation (0: none)
    norm_before_fc: bool = False  # an RMSNorm over the concatenated features before `fc` (an ablation)
    regression_weight: float = 0.0  # smooth-L1 of each step's normed state to the target's (EAGLE-1's term)
    frozen_head_steps: int = 0  # the head (initialised from the target's rows) frozen for this many steps
    vocab_from: str = "all"  # the draft vocabulary from every token (all) or the answers' only (answers)
    loop: LoopConfig = field(default_factory=lambda: LoopConfig(epochs=4, lr=5e-4, eval_every=100))


@dataclass
class Example:
    """One sequence, ready for training: what it reads and what it is scored against."""

    tokens: torch.Tensor  # (n,) long
    features: torch.Tensor  # (n, A·H) float16: the residual streams at the aux layers, position by position
    argmax: torch.Tensor  # (n,) draft id of the target's argmax for the token after position p; −1 none
    topk_ids: torch.Tensor  # (n, K) draft ids, −1 outside the draft vocabulary
    topk_p: torch.Tensor  # (n, K) renormalised over the draft vocabulary
    weight: torch.Tensor  # (n,) loss weight of a label at position p (0: none)
    hidden: torch.Tensor | None = None  # (n, H) float16: the target's final hidden state (regression; else None)


def build_drafter(
    target, aux_layers: tuple[int, ...], vocab: torch.Tensor, norm_before_fc: bool = False
) -> Eagle3Drafter:
    """A fresh drafter for `target` (a transformers Llama-family model): its shapes, its rotary
    settings, its embedding (shared), its final norm and its head rows for `vocab` (sorted target ids)."""
    c = target.config
    config = Eagle3Config(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        rms_norm_eps=float(c.rms_norm_eps),
        rope_theta=float(getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]),
        max_position_embeddings=c.max_position_embeddings,
        vocab_size=c.vocab_size,
        draft_vocab_size=len(vocab),
        aux_layer_ids=tuple(aux_layers),
        norm_before_fc=norm_before_fc,
    )
    drafter = Eagle3Drafter(config, target.get_input_embeddings())
    with torch.no_grad():
        drafter.lm_head.weight.copy_(target.get_output_embeddings().weight[vocab])
        drafter.norm.weight.copy_(target.model.norm.weight)
        drafter.d2t.copy_(vocab - torch.arange(len(vocab)))
        drafter.t2d.zero_()[vocab] = True
    return drafter


def vocab_tokens(s: Sequence, source: str) -> torch.Tensor:
    """The ids a sequence lends the vocabulary count: its tokens and the target's argmaxes, all of
    them or the answer's only."""
    if source == "answers":
        return torch.cat([s.tokens[s.prompt_len :], s.argmax[max(0, s.prompt_len - 1) :]])
    if source != "all":
        raise UserError(f"vocab_from {source!r}: all or answers")
    return torch.cat([s.tokens, s.argmax])


def vocab_coverage(seqs: list[Sequence], index: torch.Tensor) -> float:
    """The share of the target's next tokens at answer positions that the draft vocabulary holds."""
    labels = torch.cat([s.argmax[max(0, s.prompt_len - 1) :].long() for s in seqs])
    return float((index[labels] >= 0).float().mean()) if len(labels) else 1.0


def trained_parameters(drafter: Eagle3Drafter) -> dict[str, torch.nn.Parameter]:
    """Everything but the shared embedding."""
    return {n: p for n, p in drafter.named_parameters() if not n.startswith("embed_tokens.")}


@torch.inference_mode()
def cache_features(model, data: Path, aux_layers: tuple[int, ...], log=print) -> Path:
    """The target's residual streams at `aux_layers` for every cached sequence, one file per data
    shard (made once; a stopped run resumes at the next missing shard)."""
    folder = data / FEATURES / "-".join(map(str, aux_layers))
    folder.mkdir(parents=True, exist_ok=True)
    todo = [s for s in shards(data) if not (folder / s.name).exists()]
    started = time.perf_counter()
    for i, shard in enumerate(todo):
        seqs = torch.load(shard)["sequences"]
        out = [aux_features(model, s["tokens"], aux_layers) for s in seqs]
        tmp = (folder / shard.name).with_suffix(".tmp")
        torch.save(out, tmp)
        tmp.rename(folder / shard.name)
        log(f"features: {shard.name} ({i + 1}/{len(todo)}, {time.perf_counter() - started:.0f} s)")
    return folder


@torch.inference_mode()
def aux_features(model, tokens: torch.Tensor, aux_layers: tuple[int, ...]) -> torch.Tensor:
    """The target's residual streams after `aux_layers` at every position of `tokens`, (n, A·H) fp16."""
    states = model.model(input_ids=tokens[None].long(), output_hidden_states=True).hidden_states  # no head
    return torch.cat([states[k][0] for k in aux_layers], -1).half()


def sequence_examples(model, seqs: list[Sequence], layers, index: torch.Tensor, cfg: EagleTrainConfig) -> list[Example]:
    """Sequences with the teacher's view (the held-out set) as examples, their features computed here."""
    return [example(s, aux_features(model, s.tokens, layers), index, cfg) for s in seqs]


def heldout_agreement(drafter: Eagle3Drafter, exs: list[Example], steps: int) -> dict[str, float]:
    """agreement() on the held-out Spec-Bench answers, its keys prefixed `heldout_`."""
    return {"heldout_" + k.removeprefix("val_"): v for k, v in agreement(drafter, exs, steps).items()}


def examples(data: Path, folder: Path, index: torch.Tensor, cfg: EagleTrainConfig, holdout: bool) -> list[Example]:
    """The training (or held-out: every `holdout_every`-th) sequences with their features, labels in draft ids."""
    features = [f for shard in shards(data) for f in torch.load(folder / shard.name)]
    chosen = zip(load_sequences(data, hidden=False), features, strict=True)
    return [example(s, f, index, cfg) for i, (s, f) in enumerate(chosen) if (i % cfg.holdout_every == 0) == holdout]


def store_examples(store: FeatureStore, index: torch.Tensor, cfg: EagleTrainConfig, validation: bool) -> list[Example]:
    """The store's training (or validation: the corpus's split, by source) sequences as examples;
    their arrays stay memory-mapped until a batch reads them."""
    return [example(store_sequence(store, s), store.sequence(s)["aux"], index, cfg) for s in store.indices(validation)]


def example(s: Sequence, features: torch.Tensor, index: torch.Tensor, cfg: EagleTrainConfig) -> Example:
    """`index`: target id → draft id (−1 outside). Labels at positions 0..n−2; the last has none."""
    n = len(s.tokens)
    argmax = torch.full((n,), -1, dtype=torch.long)
    argmax[:-1] = index[s.argmax.long()]
    ids = index[s.topk_ids.long()]  # (n−1, K)
    p = s.topk_logp.float().exp() * (ids >= 0)
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
    weight = torch.zeros(n)
    weight[:-1] = 1.0
    weight[: max(0, s.prompt_len - 1)] = cfg.prompt_weight
    cut = max(0, n - cfg.max_tokens)
    pad = torch.full((1, ids.shape[1]), -1, dtype=torch.long)
    hidden = None
    if cfg.regression_weight and s.hidden is not None:  # the last position has no record: zeros, weight 0
        hidden = torch.cat([s.hidden, torch.zeros(1, s.hidden.shape[1], dtype=s.hidden.dtype)])[cut:]
    return Example(
        hidden=hidden,
        tokens=s.tokens.long()[cut:],
        features=features[cut:],
        argmax=argmax[cut:],
        topk_ids=torch.cat([ids, pad])[cut:],
        topk_p=torch.cat([p, torch.zeros(1, ids.shape[1])])[cut:],
        weight=weight[cut:],
    )


def collate(exs: list[Example]) -> dict[str, torch.Tensor]:
    """Right-padded batch tensors (padding has weight 0)."""
    length = max(len(e.tokens) for e in exs)
    b, k = len(exs), exs[0].topk_ids.shape[1]
    batch = {
        "tokens": torch.zeros(b, length, dtype=torch.long),
        "features": torch.zeros(b, length, exs[0].features.shape[1], dtype=torch.float16),
        "argmax": torch.full((b, length), -1, dtype=torch.long),
        "topk_ids": torch.full((b, length, k), -1, dtype=torch.long),
        "topk_p": torch.zeros(b, length, k),
        "weight": torch.zeros(b, length),
    }
    if exs[0].hidden is not None:
        batch["hidden"] = torch.zeros(b, length, exs[0].hidden.shape[1], dtype=torch.float16)
    for r, e in enumerate(exs):
        n = len(e.tokens)
        for name in batch:
            batch[name][r, :n] = getattr(e, name)
    return batch


def unroll(drafter: Eagle3Drafter, batch: dict[str, torch.Tensor], steps: int, states: list | None = None):
    """Training-time test: yields (step j, draft logits (B, T, V_d)) for j = 1..steps over every
    chain base i < T = L − 1 (see the module docstring); `states`, if given, gets each step's
    normed state (B, T, H), the one its head reads."""
    layer, c = drafter.midlayer, drafter.config
    tokens = batch["tokens"]
    b, length = tokens.shape
    t = length - 1
    hidden = drafter.fuse(batch["features"][:, :t].float())  # (B, T, H)
    keys, values = [], []
    base = torch.arange(t)
    for j in range(1, steps + 1):
        step_tokens = F.pad(tokens, (0, j))[:, j : j + t]  # token i+j for chain i
        x = torch.cat([layer.input_layernorm(drafter.embed_tokens(step_tokens)), layer.hidden_norm(hidden)], -1)
        attn = layer.self_attn
        q = attn.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)  # (B, h, T, d)
        k = attn.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)  # (B, kv, T, d)
        v = attn.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = drafter.rotary(hidden, (base + j - 1)[None])  # (1, T, d)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys.append(k)
        values.append(v)
        mask = _ttt_mask(t, j)  # (T, j·T): step 1's entries causally, then each later step's own chain
        y = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask, enable_gqa=True)
        h = hidden + attn.o_proj(y.transpose(1, 2).reshape(b, t, -1))
        hidden = h + layer.mlp(layer.post_attention_layernorm(h))
        normed = drafter.norm(hidden)
        if states is not None:
            states.append(normed)
        yield j, drafter.lm_head(normed)


def _ttt_mask(t: int, steps: int) -> torch.Tensor:
    first = torch.ones(t, t, dtype=torch.bool).tril()
    return torch.cat([first] + [torch.eye(t, dtype=torch.bool)] * (steps - 1), dim=1)


def _labels(batch: dict[str, torch.Tensor], j: int, t: int) -> tuple[torch.Tensor, ...]:
    """The labels of step j for chain bases 0..t−1: the target's view of position i + j."""

    def shifted(x: torch.Tensor, fill) -> torch.Tensor:
        pad = (0, 0, 0, j) if x.dim() == 3 else (0, j)
        return F.pad(x, pad, value=fill)[:, j : j + t]

    return (
        shifted(batch["argmax"], -1),
        shifted(batch["topk_ids"], -1),
        shifted(batch["topk_p"], 0.0),
        shifted(batch["weight"], 0.0),
    )


def losses(drafter: Eagle3Drafter, batch: dict[str, torch.Tensor], cfg: EagleTrainConfig):
    total, stats = 0.0, {}
    t = batch["tokens"].shape[1] - 1
    states = [] if cfg.regression_weight else None
    for j, logits in unroll(drafter, batch, cfg.ttt_steps, states):
        argmax, ids, p, weight = _labels(batch, j, t)
        logp = torch.log_softmax(logits.float(), -1)  # (B, T, V_d)
        hard = -logp.gather(-1, argmax.clamp(min=0)[..., None])[..., 0] * (argmax >= 0)
        soft = -(p * logp.gather(-1, ids.clamp(min=0))).sum(-1)
        per = (hard + cfg.soft_weight * soft) * weight
        if states is not None:  # toward the state the target's head read at the labelled position
            goal = F.pad(batch["hidden"], (0, 0, 0, j))[:, j : j + t].float()
            per = per + cfg.regression_weight * F.smooth_l1_loss(states[-1], goal, reduction="none").mean(-1) * weight
        loss = per.sum() / weight.sum().clamp(min=1)
        total = total + cfg.step_decay ** (j - 1) * loss
        stats[f"loss{j}"] = float(loss.detach())
    return total, stats


@torch.no_grad()
def agreement(drafter: Eagle3Drafter, exs: list[Example], steps: int, budget: int = 4096) -> dict[str, float]:
    """Teacher-forced, on answer positions (weight 1): per step, top-1 agreement with the target's
    argmax (a label outside the draft vocabulary is a miss); and the tokens a greedy chain of
    `steps` drafts yields per target forward, 1 + Σ_j P(drafts 1..j right), over chains whose
    every label lies in an answer."""
    right, counted, alive_sum = torch.zeros(steps), torch.zeros(steps), torch.zeros(steps)
    complete = 0.0
    for group in batches_of(exs, budget, random.Random(0)):
        batch = collate(group)
        t = batch["tokens"].shape[1] - 1
        reach = alive = None
        alives = []
        for j, logits in unroll(drafter, batch, steps):
            argmax, _, _, weight = _labels(batch, j, t)
            answer = weight == 1.0
            ok = logits.argmax(-1) == argmax
            right[j - 1] += float((ok & answer).sum())
            counted[j - 1] += float(answer.sum())
            reach = answer if reach is None else reach & answer
            alive = ok if alive is None else alive & ok
            alives.append(alive)
        for j, a in enumerate(alives):
            alive_sum[j] += float((a & reach).sum())
        complete += float(reach.sum())
    result = {f"val_top1_step{j + 1}": float(right[j] / counted[j].clamp(min=1)) for j in range(steps)}
    return result | {"val_mean_accepted_tokens": 1.0 + float(alive_sum.sum()) / max(1.0, complete)}


def train_eagle(job: TrainJob, cfg: EagleTrainConfig) -> dict:
    """Train and save an EAGLE-3 drafter in `job.out` (vLLM's checkpoint format); returns the report."""
    seed_everything(cfg.loop.seed)
    started = time.perf_counter()
    model = job.target.model.requires_grad_(False)
    store = FeatureStore(job.data) if is_store(job.data) else None
    if cfg.regression_weight and store is None:
        raise UserError("the regression needs the target's final hidden states: train from a feature store")
    layers = tuple(cfg.aux_layers or default_aux_layer_ids(model.config.num_hidden_layers))
    if store is not None:
        layers = tuple(store.meta["made_from"]["config"]["aux_layers"])
        if cfg.aux_layers and tuple(cfg.aux_layers) != layers:
            raise UserError(f"the features in {job.data} are of layers {layers}, not {tuple(cfg.aux_layers)}")
    if job.start_from is not None:
        drafter = load_eagle3(job.start_from, embed=model.get_input_embeddings())
        layers = drafter.config.aux_layer_ids
    else:
        eos = sorted(job.target.eos_token_ids)
        if store is not None:
            seqs = (store_sequence(store, i) for i in store.indices(validation=False))
        else:
            seqs = load_sequences(job.data, cfg.holdout_every, holdout=False, hidden=False)
        ids = (vocab_tokens(s, cfg.vocab_from) for s in seqs)
        vocab = frequent_tokens(ids, cfg.reduced_vocab, always=eos)
        drafter = build_drafter(model, layers, vocab, cfg.norm_before_fc)
    drafter.train()
    index = drafter.to_draft_index()
    if store is not None:  # a corpus's feature store: its layers, its split
        train_exs = store_examples(store, index, cfg, validation=False)
        val_exs = store_examples(store, index, cfg, validation=True)
        if not train_exs or not val_exs:
            raise UserError(f"the features in {job.data} need sequences on both sides of the split")
    else:
        folder = cache_features(model, job.data, layers, job.log)
        train_exs = examples(job.data, folder, index, cfg, holdout=False)
        val_exs = examples(job.data, folder, index, cfg, holdout=True)
    params = trained_parameters(drafter)
    heldout, coverage = [], None
    if cfg.heldout_per_category:
        seqs = spec_bench_heldout(job.target, cfg.heldout_per_category, log=job.log)
        heldout = sequence_examples(model, seqs, layers, index, cfg)
        coverage = vocab_coverage(seqs, index)
        job.log(f"eagle: the draft vocabulary holds {coverage:.1%} of the held-out answers' target tokens")

    def epoch_batches(epoch: int) -> list[dict[str, torch.Tensor]]:
        rng = random.Random(cfg.loop.seed * 1000 + epoch)
        return [collate(group) for group in batches_of(train_exs, cfg.tokens_per_batch, rng)]

    def validate() -> dict[str, float]:
        drafter.eval()
        result = agreement(drafter, val_exs, cfg.ttt_steps)
        if heldout:
            result |= heldout_agreement(drafter, heldout, cfg.ttt_steps)
        drafter.train()
        return result

    initial = validate()
    tokens = sum(len(e.tokens) for e in train_exs)
    job.log(f"eagle: aux layers {layers}, {len(train_exs)} sequences ({tokens} tokens); before training: {initial}")

    def on_step(step: int) -> None:  # the head learns only once the body has had frozen_head_steps
        drafter.lm_head.weight.requires_grad_(step >= cfg.frozen_head_steps)

    loss_fn = lambda batch: losses(drafter, batch, cfg)  # noqa: E731
    history = job.train(params, epoch_batches, loss_fn, validate, cfg.loop, on_step)
    drafter.eval()
    drafter.embed_tokens = None  # the target's, shared: not saved, and not to be cast
    drafter.config = replace(drafter.config, trained_steps=max(cfg.ttt_steps, drafter.config.trained_steps or 0))
    save_eagle3(drafter.half(), job.out)
    return job.report(
        cfg,
        started,
        initial,
        history,
        aux_layers=list(layers),
        train_sequences=len(train_exs),
        train_tokens=tokens,
        heldout_vocab_coverage=coverage,
    )
