"""Train the sequential MTP heads (mtp_viz.drafters.heads) on the frozen target's hidden states.

Each example is an answer position t of a cached sequence. The heads start from the target's
real hidden state h_t and are unrolled `depth` times on their own predicted hidden states, fed
the real next tokens x_{t+1}, x_{t+2}, … (at test time a guess only counts while every earlier
guess was right, so the real tokens are the right condition). Depth j is scored against the
target's view of position t+j: cross entropy to its argmax and to its top-k distribution, and a
smooth-L1 pull of the predicted hidden state towards the real one (as EAGLE does), with deeper
depths weighted less.
"""

import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from mtp_viz.drafters.heads import HeadsSpec, MTPHeads, build_heads, load_heads, save_heads, trained_parameters
from mtp_viz.drafters.vocab import frequent_tokens
from mtp_viz.kernels import plan_of, use_fast_linears
from mtp_viz.training.data import Sequence, load_sequences
from mtp_viz.training.features import FeatureStore, is_store, store_sequence
from mtp_viz.training.heldout import PER_CATEGORY, as_heldout, spec_bench_heldout
from mtp_viz.training.loop import LoopConfig, TrainJob, seed_everything


@dataclass(frozen=True)
class HeadsTrainConfig:
    depth: int = 4
    reduced_vocab: int = 8192
    positions_per_batch: int = 512
    depth_decay: float = 0.8  # loss weight of depth j is depth_decay ** (j - 1)
    soft_weight: float = 0.5
    regression_weight: float = 0.1
    holdout_every: int = 20
    heldout_per_category: int = PER_CATEGORY  # Spec-Bench answers scored at every validation (0: none)
    loop: LoopConfig = field(default_factory=lambda: LoopConfig(epochs=1, lr=1e-3))


@dataclass
class Positions:
    """Every cached sequence concatenated, and where the examples start."""

    hidden: torch.Tensor  # (R, H) float16, one record per position with a next token
    argmax: torch.Tensor  # (R,)
    topk_ids: torch.Tensor  # (R, K) reduced ids, −1 outside the subset
    topk_p: torch.Tensor  # (R, K) renormalised over the subset
    tokens: torch.Tensor  # (N,) all tokens
    record: torch.Tensor  # (E,) record index of each example's position t
    token: torch.Tensor  # (E,) token index of each example's position t
    reach: torch.Tensor  # (E,) how many depths have labels (t + j must be a record of the same sequence)


def positions(seqs: list[Sequence], index: torch.Tensor, depth: int) -> Positions:
    records, tokens, starts_r, starts_t, reach = [], [], [], [], []
    r_off = t_off = 0
    for s in seqs:
        n = len(s.tokens)
        t = torch.arange(s.prompt_len - 1, n - 2)  # answer positions with at least one label
        starts_r.append(r_off + t)
        starts_t.append(t_off + t)
        reach.append((n - 2 - t).clamp(max=depth))
        records.append(s)
        tokens.append(s.tokens.long())
        r_off += n - 1
        t_off += n
    ids = index[torch.cat([s.topk_ids.long() for s in records])]
    p = torch.cat([s.topk_logp.float() for s in records]).exp() * (ids >= 0)
    return Positions(
        hidden=torch.cat([s.hidden for s in records]),
        argmax=index[torch.cat([s.argmax.long() for s in records])],
        topk_ids=ids,
        topk_p=p / p.sum(-1, keepdim=True).clamp(min=1e-9),
        tokens=torch.cat(tokens),
        record=torch.cat(starts_r),
        token=torch.cat(starts_t),
        reach=torch.cat(reach),
    )


def store_positions(store: FeatureStore, index: torch.Tensor, depth: int) -> tuple[Positions, Positions]:
    """A feature store's training and validation positions (the corpus's split), sharing its arrays
    without copying the hidden states: the store keeps one record per token (the last of each
    sequence without a label), so records and tokens share one index and the memory-mapped hidden
    states are read row by row as batches ask."""
    a = {name: torch.from_numpy(store.arrays[name]) for name in ("hidden", "argmax", "topk_ids", "topk_logp")}
    labelled = a["argmax"] >= 0
    ids = torch.where(labelled[:, None], index[a["topk_ids"].long().clamp(min=0)], -1)
    p = a["topk_logp"].float().exp() * (ids >= 0)
    shared = {
        "hidden": a["hidden"],
        "argmax": torch.where(labelled, index[a["argmax"].long().clamp(min=0)], -1),
        "topk_ids": ids,
        "topk_p": p / p.sum(-1, keepdim=True).clamp(min=1e-9),
        "tokens": torch.from_numpy(store.arrays["tokens"]).long(),
    }
    starts, prompt_len = torch.from_numpy(store.starts.astype(np.int64)), store.prompt_len.astype(np.int64)

    def split(validation: bool) -> Positions:
        chosen = torch.tensor(store.indices(validation), dtype=torch.long)
        first, end = starts[chosen] + torch.from_numpy(prompt_len)[chosen] - 1, starts[chosen + 1]
        count = (end - 2 - first).clamp(min=0)  # answer positions with at least one label
        t = torch.repeat_interleave(first, count) + _ranks(count)
        reach = (torch.repeat_interleave(end, count) - 2 - t).clamp(max=depth)
        return Positions(**shared, record=t, token=t, reach=reach)

    return split(False), split(True)


def _ranks(count: torch.Tensor) -> torch.Tensor:
    """0..c−1 for each c in `count`, concatenated."""
    offsets = torch.repeat_interleave(torch.cumsum(count, 0) - count, count)
    return torch.arange(int(count.sum())) - offsets


def unroll(heads: MTPHeads, data: Positions, rows: torch.Tensor, depth: int):
    """Yield, for j = 1..depth: (reduced log-probs (B, V'), predicted hidden (B, H), record index, mask)."""
    dtype = heads.fuse.weight.dtype
    h = data.hidden[data.record[rows]].to(dtype)
    for j in range(1, depth + 1):
        token = data.tokens[(data.token[rows] + j).clamp(max=len(data.tokens) - 1)]  # x_{t+j} (masked past the end)
        h = heads.step(h, token)
        rec = data.record[rows] + j
        mask = data.reach[rows] >= j
        yield torch.log_softmax(heads.head.reduced(h).float(), -1), h, rec.clamp(max=len(data.argmax) - 1), mask


def losses(heads: MTPHeads, data: Positions, rows: torch.Tensor, cfg: HeadsTrainConfig):
    total = torch.zeros(())
    stats = {}
    for j, (logp, h, rec, mask) in enumerate(unroll(heads, data, rows, cfg.depth), start=1):
        w = mask.float() * (data.argmax[rec] >= 0)
        n = w.sum().clamp(min=1.0)
        hard = -(logp.gather(-1, data.argmax[rec].clamp(min=0)[:, None])[:, 0] * w).sum() / n
        soft = -((logp.gather(-1, data.topk_ids[rec].clamp(min=0)) * data.topk_p[rec]).sum(-1) * w).sum() / n
        reg = (torch.nn.functional.smooth_l1_loss(h, data.hidden[rec].to(h.dtype), reduction="none").mean(-1) * w).sum()
        loss = (1 - cfg.soft_weight) * hard + cfg.soft_weight * soft + cfg.regression_weight * reg / n
        total = total + cfg.depth_decay ** (j - 1) * loss
        stats[f"ce{j}"] = hard.item()
    return total, stats


@torch.no_grad()
def agreement(heads: MTPHeads, data: Positions, depth: int, batch: int = 4096) -> dict[str, float]:
    """Per depth: top-1 agreement with the target given a right prefix; and the expected tokens a
    greedy chain of `depth` guesses yields per target forward (1 + Σ_j P(guesses 1..j all right))."""
    right = torch.zeros(depth)
    chain = torch.zeros(depth)
    counted = torch.zeros(depth)
    for start in range(0, len(data.record), batch):
        rows = torch.arange(start, min(start + batch, len(data.record)))
        full = data.reach[rows] >= depth
        alive = torch.ones(len(rows), dtype=torch.bool)
        for j, (logp, _, rec, mask) in enumerate(unroll(heads, data, rows, depth)):
            ok = logp.argmax(-1) == data.argmax[rec]
            right[j] += float((ok & mask).sum())
            counted[j] += float(mask.sum())
            alive &= ok
            chain[j] += float((alive & full).sum())
    n_full = float((data.reach >= depth).sum())
    result = {f"val_top1_depth{j + 1}": float(right[j] / counted[j].clamp(min=1)) for j in range(depth)}
    result["val_mean_accepted_tokens"] = 1.0 + float(chain.sum()) / max(1.0, n_full)
    return result


def train_heads(job: TrainJob, cfg: HeadsTrainConfig) -> dict:
    """Train and save heads in `job.out`; returns the report (also out/training.json)."""
    seed_everything(cfg.loop.seed)
    started = time.perf_counter()
    store = FeatureStore(job.data) if is_store(job.data) else None
    if store is not None:  # a corpus's feature store: its split, its arrays memory-mapped
        train_seqs = [store_sequence(store, i) for i in store.indices(validation=False)]
    else:
        train_seqs = list(load_sequences(job.data, cfg.holdout_every, holdout=False))
        val_seqs = list(load_sequences(job.data, cfg.holdout_every, holdout=True))
    model = job.target.model
    if job.start_from is not None:  # continue training saved heads (their vocabulary and spec)
        heads = use_fast_linears(load_heads(model, job.start_from), plan_of(model)).train()  # as build_heads does
        heads.spec = replace(heads.spec, trained_depth=cfg.depth)
    else:
        eos = sorted(job.target.eos_token_ids)
        vocab = frequent_tokens((torch.cat([s.tokens, s.argmax]) for s in train_seqs), cfg.reduced_vocab, always=eos)
        spec = HeadsSpec(
            base=job.target.name,
            hidden_size=model.config.hidden_size,
            intermediate_size=model.config.intermediate_size,
            vocab_size=model.config.vocab_size,
            reduced_vocab=len(vocab),
            trained_depth=cfg.depth,
            eps=float(getattr(model.config, "rms_norm_eps", 1e-5)),
        )
        heads = build_heads(model, spec, vocab).train()
    index = heads.head.index.cpu()
    if store is not None:
        train_data, val_data = store_positions(store, index, cfg.depth)
    else:
        train_data = positions(train_seqs, index, cfg.depth)
        val_data = positions(val_seqs, index, cfg.depth)
        del val_seqs
    del train_seqs
    heldout = None
    if cfg.heldout_per_category:
        heldout = positions(spec_bench_heldout(job.target, cfg.heldout_per_category, log=job.log), index, cfg.depth)
    params = trained_parameters(heads)
    n = len(train_data.record)
    per_epoch = max(1, n // cfg.positions_per_batch)

    def epoch_batches(epoch: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(cfg.loop.seed * 1000 + epoch)
        return list(torch.randperm(n, generator=g)[: per_epoch * cfg.positions_per_batch].view(per_epoch, -1))

    def validate() -> dict[str, float]:
        heads.eval()
        result = agreement(heads, val_data, cfg.depth)
        result |= as_heldout(agreement(heads, heldout, cfg.depth)) if heldout is not None else {}
        heads.train()
        return result

    initial = validate()
    job.log(f"heads: {n} training positions, {len(heads.head.ids)}-token vocabulary; before training: {initial}")
    history = job.train(params, epoch_batches, lambda rows: losses(heads, train_data, rows, cfg), validate, cfg.loop)
    heads.eval()
    save_heads(heads, job.out)
    return job.report(cfg, started, initial, history, train_positions=n, val_positions=len(val_data.record))
