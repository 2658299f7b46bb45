"""Distil a small draft model from the frozen target (mtp_viz.drafters.draft).

Data: the cached self-distillation set (mtp_viz.training.data). Loss at each position: cross
entropy to the target's argmax (what greedy verification checks) plus cross entropy to its top-k
distribution renormalised over the reduced vocabulary (what sampling verification rewards),
prompt positions down-weighted since drafting happens in answers. Validation: top-1 agreement
with the target on held-out sequences' answer positions, the teacher-forced estimate of the
per-token acceptance α in greedy mode.
"""

import random
import time
from dataclasses import dataclass, field

import torch

from mtp_viz.drafters.draft import DraftSpec, build_draft, load_draft, read_spec, save_draft, trained_parameters
from mtp_viz.drafters.vocab import frequent_tokens
from mtp_viz.training.data import Sequence
from mtp_viz.training.features import training_sequences
from mtp_viz.training.heldout import PER_CATEGORY, as_heldout, spec_bench_heldout
from mtp_viz.training.loop import LoopConfig, TrainJob, seed_everything


@dataclass(frozen=True)
class DraftTrainConfig:
    layers: int = 2
    reduced_vocab: int = 8192
    tokens_per_batch: int = 2048
    prompt_weight: float = 0.2
    soft_weight: float = 0.5
    holdout_every: int = 20  # every n-th cached sequence is held out for validation
    heldout_per_category: int = PER_CATEGORY  # Spec-Bench answers scored at every validation (0: none)
    loop: LoopConfig = field(default_factory=lambda: LoopConfig(epochs=2, lr=5e-4))


def spread_layers(total: int, n: int) -> tuple[int, ...]:
    """n target layers evenly spread from the first to the last: where the draft's layers start."""
    if n == 1:
        return (0,)
    return tuple(round(i * (total - 1) / (n - 1)) for i in range(n))


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T)
    attention: torch.Tensor  # (B, T) 1 where real
    hard: torch.Tensor  # (B, T) reduced id of the target's argmax for the next token, −1: no label
    soft_ids: torch.Tensor  # (B, T, K) reduced ids of the target's top-k, −1 outside the subset
    soft_p: torch.Tensor  # (B, T, K) their probabilities, renormalised over the subset
    weight: torch.Tensor  # (B, T)
    answer: torch.Tensor  # (B, T) bool: answer positions (validation counts these)


def collate(seqs: list[Sequence], index: torch.Tensor, prompt_weight: float) -> Batch:
    """Right-padded batch; `index` maps full ids to reduced ids (−1 if absent)."""
    width = max(len(s.tokens) for s in seqs)
    k = seqs[0].topk_ids.shape[1]
    b = Batch(
        input_ids=torch.zeros(len(seqs), width, dtype=torch.long),
        attention=torch.zeros(len(seqs), width, dtype=torch.long),
        hard=torch.full((len(seqs), width), -1, dtype=torch.long),
        soft_ids=torch.full((len(seqs), width, k), -1, dtype=torch.long),
        soft_p=torch.zeros(len(seqs), width, k),
        weight=torch.zeros(len(seqs), width),
        answer=torch.zeros(len(seqs), width, dtype=torch.bool),
    )
    for r, s in enumerate(seqs):
        n = len(s.tokens)
        b.input_ids[r, :n] = s.tokens.long()
        b.attention[r, :n] = 1
        b.hard[r, : n - 1] = index[s.argmax.long()]
        ids = index[s.topk_ids.long()]
        p = s.topk_logp.float().exp() * (ids >= 0)
        b.soft_ids[r, : n - 1] = ids
        b.soft_p[r, : n - 1] = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
        b.weight[r, : s.prompt_len - 1] = prompt_weight
        b.weight[r, s.prompt_len - 1 : n - 1] = 1.0
        b.answer[r, s.prompt_len - 1 : n - 1] = True
    return b


def batches_of(seqs: list, tokens_per_batch: int, rng: random.Random, order=None, limits=()) -> list[list]:
    """Groups of at most `tokens_per_batch` padded tokens (rows × the longest row), consecutive in
    `order` (default: length, so that rows pad little), in shuffled order; `limits`: more (size of
    a row, budget) bounds each group keeps (rows × its largest size ≤ budget)."""
    bounds = [(lambda s: len(s.tokens), tokens_per_batch), *limits]
    groups, group, largest = [], [], [0] * len(bounds)
    for s in sorted(seqs, key=order or (lambda s: len(s.tokens))):
        sizes = [size(s) for size, _ in bounds]
        if group and any(max(m, n) * (len(group) + 1) > b for m, n, (_, b) in zip(largest, sizes, bounds, strict=True)):
            groups.append(group)
            group, largest = [], [0] * len(bounds)
        group.append(s)
        largest = [max(m, n) for m, n in zip(largest, sizes, strict=True)]
    if group:
        groups.append(group)
    rng.shuffle(groups)
    return groups


def losses(draft, batch: Batch, soft_weight: float) -> tuple[torch.Tensor, dict[str, float]]:
    hidden = draft.model(input_ids=batch.input_ids, attention_mask=batch.attention, use_cache=False).last_hidden_state
    logp = torch.log_softmax(draft.lm_head.reduced(hidden).float(), -1)  # (B, T, V')
    w = batch.weight * (batch.hard >= 0)
    hard = -logp.gather(-1, batch.hard.clamp(min=0)[..., None])[..., 0]  # (B, T)
    soft = -(logp.gather(-1, batch.soft_ids.clamp(min=0)) * batch.soft_p).sum(-1)  # (B, T)
    total = w.sum().clamp(min=1.0)
    hard_loss = (hard * w).sum() / total
    soft_loss = (soft * w).sum() / total
    loss = (1 - soft_weight) * hard_loss + soft_weight * soft_loss
    return loss, {"loss": loss.item(), "hard": hard_loss.item()}


@torch.no_grad()
def scored_batches(seqs: list[Sequence], index: torch.Tensor, tokens_per_batch: int) -> list[Batch]:
    """Validation batches of `seqs` (every answer position counted, grouped the same way every
    time), for `agreement`: what the trainer validates on, and what a check of a saved draft reads."""
    return [collate(g, index, 1.0) for g in batches_of(seqs, tokens_per_batch, random.Random(0))]


def agreement(draft, batches: list[Batch]) -> dict[str, float]:
    """Top-1 agreement with the target's argmax at answer positions (teacher forcing)."""
    hits = total = 0
    for batch in batches:
        hidden = draft.model(
            input_ids=batch.input_ids, attention_mask=batch.attention, use_cache=False
        ).last_hidden_state
        guess = draft.lm_head.reduced(hidden).argmax(-1)
        mask = batch.answer
        hits += int(((guess == batch.hard) & mask).sum())
        total += int(mask.sum())
    return {"val_agreement": hits / max(1, total)}


def train_draft(job: TrainJob, cfg: DraftTrainConfig) -> dict:
    """Train and save a draft in `job.out`; returns the report (also out/training.json)."""
    seed_everything(cfg.loop.seed)
    started = time.perf_counter()
    train_seqs = list(training_sequences(job.data, cfg.holdout_every, holdout=False, hidden=False))
    val_seqs = list(training_sequences(job.data, cfg.holdout_every, holdout=True, hidden=False))
    model = job.target.model
    if job.start_from is not None:  # continue training a saved draft (its layers and vocabulary)
        draft = load_draft(model, job.start_from).train()
        init = read_spec(job.start_from).init_layers
    else:
        eos = sorted(job.target.eos_token_ids)
        vocab = frequent_tokens((torch.cat([s.tokens, s.argmax]) for s in train_seqs), cfg.reduced_vocab, always=eos)
        init = spread_layers(model.config.num_hidden_layers, cfg.layers)
        draft = build_draft(model, init, vocab).train()
    vocab = draft.lm_head.ids.cpu()
    index = draft.lm_head.index.cpu()
    params = trained_parameters(draft)
    for p in params.values():
        p.requires_grad_(True)

    val_batches = scored_batches(val_seqs, index, cfg.tokens_per_batch)
    heldout = []
    if cfg.heldout_per_category:  # the Spec-Bench answers, scored as the validation side is
        heldout_seqs = spec_bench_heldout(job.target, cfg.heldout_per_category, log=job.log)
        heldout = scored_batches(heldout_seqs, index, cfg.tokens_per_batch)

    def epoch_batches(epoch: int) -> list[list[Sequence]]:
        return batches_of(train_seqs, cfg.tokens_per_batch, random.Random(cfg.loop.seed * 1000 + epoch))

    def validate() -> dict[str, float]:
        draft.eval()
        result = agreement(draft, val_batches) | (as_heldout(agreement(draft, heldout)) if heldout else {})
        draft.train()
        return result

    initial = validate()
    job.log(f"draft from target layers {init}, {len(vocab)}-token vocabulary; before training: {initial}")
    history = job.train(
        params,
        epoch_batches,
        lambda group: losses(draft, collate(group, index, cfg.prompt_weight), cfg.soft_weight),
        validate,
        cfg.loop,
    )
    draft.eval()
    spec = DraftSpec(
        base=job.target.name,
        init_layers=init,
        hidden_size=model.config.hidden_size,
        vocab_size=model.config.vocab_size,
        reduced_vocab=len(vocab),
    )
    save_draft(draft, spec, job.out)
    tokens = sum(len(s.tokens) for s in train_seqs)
    sizes = {"train_sequences": len(train_seqs), "train_tokens": tokens, "val_sequences": len(val_seqs)}
    return job.report(cfg, started, initial, history, **sizes)
