"""Train a mask-token MTP model (mtp_viz.drafters.mask) by self-distillation, the way "Multi-Token
Prediction via Self-Distillation" (Kirchenbauer et al., arXiv 2602.06019) does, at CPU scale.

The data are the frozen model's own answers (mtp_viz.training.data). Each step packs a few
sequences into one row (block-diagonal causal attention) and inserts MTP regions into them: after
a prefix ending at answer position t, k−1 mask tokens at positions t+1 … t+k−1 (k random in
[2, k_max], anchors at random). A region sees its sequence's ground truth up to t and its own
masks (causal); later ground truth never sees a region. Mask j predicts token t+j+1.

The objective is the paper's "student-forced" one with a hard teacher: the student's argmax
tokens y′ for a region are fed to the teacher (the untouched model) after the same prefix; the
teacher's argmax after each of them is the label of the student's next prediction. The first
token the teacher reads is the model's own next-token prediction at t (from the data cache),
which is what the student emits first. No loss on real positions.

Three passes per step, so only the masks pay for gradients: the real tokens once without
gradients (their key/values are the teacher's prefix, and with mask-only gating the student's
too); the masks with gradients, over those key/values; the teacher over the student's tokens,
over the same key/values. With `gating=everywhere` the student's real positions are not the
teacher's, so the student's real pass runs with gradients and the teacher keeps its own prefix.
"""

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from peft.tuners.lora import LoraLayer
from transformers import DynamicCache

from mtp_viz.cache import additive_mask
from mtp_viz.drafters.mask import (
    GATINGS,
    MASK_ONLY,
    MaskSpec,
    adapter_parameters,
    load_mask_model,
    mask_model,
    save_mask_model,
)
from mtp_viz.errors import UserError
from mtp_viz.kernels import stock_linears
from mtp_viz.training.data import Sequence
from mtp_viz.training.features import training_sequences
from mtp_viz.training.heldout import PER_CATEGORY, as_heldout, spec_bench_heldout
from mtp_viz.training.loop import LoopConfig, TrainJob, seed_everything


@dataclass(frozen=True)
class MaskTrainConfig:
    k_max: int = 4
    rank: int = 16
    alpha: float = 32.0
    gating: str = MASK_ONLY
    tokens_per_batch: int = 1024  # real tokens packed into one step
    region_density: float = 0.25  # regions per answer token
    max_len: int = 448  # longer sequences are cut: a long prompt's start first (fitted), then the end
    holdout_every: int = 20
    val_sequences: int = 12
    val_stride: int = 3  # validation regions at every n-th answer position, with k = k_max
    heldout_per_category: int = PER_CATEGORY  # Spec-Bench answers scored at every validation (0: none)
    loop: LoopConfig = field(
        default_factory=lambda: LoopConfig(
            epochs=20, lr=1e-3, warmup_steps=30, eval_every=50, checkpoint_every=25, max_steps=600
        )
    )

    def __post_init__(self):
        if self.k_max < 2:
            raise UserError(f"k_max must be at least 2 (one mask), got {self.k_max}")
        if self.gating not in GATINGS:
            raise UserError(f"gating must be one of {', '.join(GATINGS)}, got {self.gating!r}")
        if self.loop.max_steps < 1:
            raise UserError(f"the training budget must be at least one step, got {self.loop.max_steps}")


@dataclass(frozen=True)
class Region:
    seq: int  # index into the batch's sequences
    anchor: int  # position t of the last real token it sees
    k: int  # predictions it trains: the real token's next plus k−1 masks


@dataclass
class Packed:
    """A step's real tokens (several sequences in one row) and its regions' mask tokens."""

    ids: torch.Tensor  # (N,) real tokens
    positions: torch.Tensor  # (N,)
    real_allowed: torch.Tensor  # (N, N) block-diagonal causal
    mask_positions: torch.Tensor  # (M,)
    mask_allowed: torch.Tensor  # (M, N + M): own prefix, own region (causal)
    first: torch.Tensor  # (M,) the model's next token at each region's anchor, repeated per mask
    slot: torch.Tensor  # (M,) j = 1 … k−1 within its region
    region: torch.Tensor  # (M,) region index


def pack(seqs: list[Sequence], regions: list[Region], max_len: int) -> Packed:
    starts, ids, positions = [], [], []
    offset = 0
    for s in seqs:
        n = min(len(s.tokens), max_len)
        starts.append(offset)
        ids.append(s.tokens[:n].long())
        positions.append(torch.arange(n))
        offset += n
    n_real = offset
    real_allowed = torch.zeros(n_real, n_real, dtype=torch.bool)
    for start, p in zip(starts, positions, strict=True):
        end = start + len(p)
        real_allowed[start:end, start:end] = torch.ones(len(p), len(p), dtype=torch.bool).tril()
    m = sum(r.k - 1 for r in regions)
    mask_allowed = torch.zeros(m, n_real + m, dtype=torch.bool)
    mask_positions, first, slot, region = [], [], [], []
    row = 0
    for index, r in enumerate(regions):
        start, width = starts[r.seq], r.k - 1
        mask_allowed[row : row + width, start : start + r.anchor + 1] = True
        mask_allowed[row : row + width, n_real + row : n_real + row + width] = torch.ones(width, width).tril().bool()
        mask_positions += range(r.anchor + 1, r.anchor + r.k)
        first += [int(seqs[r.seq].argmax[r.anchor])] * width
        slot += range(1, r.k)
        region += [index] * width
        row += width
    return Packed(
        ids=torch.cat(ids),
        positions=torch.cat(positions),
        real_allowed=real_allowed,
        mask_positions=torch.tensor(mask_positions, dtype=torch.long),
        mask_allowed=mask_allowed,
        first=torch.tensor(first, dtype=torch.long),
        slot=torch.tensor(slot, dtype=torch.long),
        region=torch.tensor(region, dtype=torch.long),
    )


def teacher_inputs(packed: Packed, student: torch.Tensor) -> torch.Tensor:
    """(M,) what the teacher reads at each region slot j: the model's own next token at the anchor
    for j = 1, else the student's prediction at slot j−1 (the token it would emit there)."""
    previous = torch.cat([packed.first[:1], student[:-1]])  # the previous row's student token
    return torch.where(packed.slot == 1, packed.first, previous)


def leading_correct(packed: Packed, right: torch.Tensor) -> torch.Tensor:
    """Per region: how many of its predictions, from slot 1 on, are right before the first wrong one."""
    count = torch.zeros(int(packed.region.max()) + 1 if len(packed.region) else 0, dtype=torch.long)
    alive = torch.ones_like(count, dtype=torch.bool)
    for j in range(1, int(packed.slot.max()) + 1 if len(packed.slot) else 1):
        rows = packed.slot == j
        ok = torch.zeros_like(alive)
        ok[packed.region[rows]] = right[rows]
        has = torch.zeros_like(alive)
        has[packed.region[rows]] = True
        alive &= ok | ~has
        count += (alive & has).long()
    return count


def _decoder(view, ids, positions, allowed, cache: DynamicCache) -> torch.Tensor:
    out = view.get_decoder()(
        input_ids=ids[None],
        attention_mask=additive_mask(allowed, view.dtype, view.device),
        position_ids=positions[None],
        past_key_values=cache,
        use_cache=True,
    )
    return out.last_hidden_state[0]  # (S, H)


def student_and_teacher(view, packed: Packed, mask_token_id: int, shared_prefix: bool, grad: bool):
    """(student logits at the masks (M, V), teacher labels (M,)). shared_prefix: the student's real
    positions are the teacher's (mask-only gating), so one prefix pass serves both."""
    masks = torch.full_like(packed.mask_positions, mask_token_id)
    cache = DynamicCache(config=view.config)
    with torch.set_grad_enabled(grad and not shared_prefix), untouched(view) if shared_prefix else nullcontext():
        _decoder(view, packed.ids, packed.positions, packed.real_allowed, cache)
    with torch.set_grad_enabled(grad):
        hidden = _decoder(view, masks, packed.mask_positions, packed.mask_allowed, cache)
        logits = view.lm_head(hidden)[:, : view.config.vocab_size].float()  # (M, V)
    student = logits.detach().argmax(-1)
    with torch.no_grad(), untouched(view):
        if shared_prefix:
            cache.crop(-len(masks))  # the masks go; the real prefix stays
        else:  # the teacher's own prefix
            cache = DynamicCache(config=view.config)
            _decoder(view, packed.ids, packed.positions, packed.real_allowed, cache)
        hidden = _decoder(view, teacher_inputs(packed, student), packed.mask_positions, packed.mask_allowed, cache)
        labels = view.lm_head(hidden)[:, : view.config.vocab_size].argmax(-1)  # (M,)
    return logits, labels


@contextmanager
def untouched(view):
    """The base model for the duration: every LoRA layer's adapter off (peft's own switch)."""
    layers = [m for m in view.modules() if isinstance(m, LoraLayer)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield view
    finally:
        for m in layers:
            m.enable_adapters(True)


def fitted(s: Sequence, max_len: int) -> Sequence:
    """The sequence with its prompt's start cut so that at least half of `max_len` (or the whole
    answer) follows the prompt: a long prompt (a document) leaves answer positions to train on.
    The window is a sequence of its own: the student and the teacher read the same context."""
    answer = len(s.tokens) - s.prompt_len
    cut = max(0, s.prompt_len - (max_len - min(answer, max_len // 2)))
    if cut == 0:
        return s
    return Sequence(s.tokens[cut:], s.prompt_len - cut, None, s.argmax[cut:], s.topk_ids[cut:], s.topk_logp[cut:])


def sample_regions(seqs: list[Sequence], cfg: MaskTrainConfig, generator: torch.Generator) -> list[Region]:
    regions = []
    for i, s in enumerate(seqs):
        n = min(len(s.tokens), cfg.max_len)
        anchors = torch.arange(s.prompt_len - 1, n - 1)  # answer positions with a next token
        count = max(1, round(cfg.region_density * len(anchors))) if len(anchors) else 0
        chosen = anchors[torch.randperm(len(anchors), generator=generator)[:count]].sort().values
        ks = torch.randint(2, cfg.k_max + 1, (len(chosen),), generator=generator)
        regions += [Region(i, int(t), min(int(k), n - int(t))) for t, k in zip(chosen, ks, strict=True)]
    return [r for r in regions if r.k >= 2]


def packs(seqs: list[Sequence], budget: int, max_len: int, order: torch.Tensor) -> list[list[int]]:
    """Sequence indices grouped so each group has at most `budget` real tokens (at least one sequence)."""
    groups, group, size = [], [], 0
    for i in order.tolist():
        n = min(len(seqs[i].tokens), max_len)
        if group and size + n > budget:
            groups.append(group)
            group, size = [], 0
        group.append(i)
        size += n
    return groups + ([group] if group else [])


@torch.no_grad()
def validate(view, val: list[Packed], mask_token_id: int, shared_prefix: bool) -> dict[str, float]:
    """Held-out: per-slot top-1 agreement with the teacher's label, and the tokens per forward a
    verified mask-token step yields (1 + the mean run of right predictions from slot 1)."""
    right_by_slot: dict[int, list[float]] = {}
    runs = []
    for packed in val:
        logits, labels = student_and_teacher(view, packed, mask_token_id, shared_prefix, grad=False)
        right = logits.argmax(-1) == labels
        for j in packed.slot.unique().tolist():
            right_by_slot.setdefault(j, []).append(float(right[packed.slot == j].float().mean()))
        runs.append(leading_correct(packed, right).float())
    result = {f"val_top1_mask{j}": sum(v) / len(v) for j, v in sorted(right_by_slot.items())}
    result["val_tokens_per_forward"] = 1.0 + float(torch.cat(runs).mean())
    return result


def validation_packs(seqs: list[Sequence], cfg: "MaskTrainConfig") -> list[Packed]:
    """`seqs` packed for validate(): regions every `val_stride` answer positions, k_max slots each."""
    out = []
    for group in packs(seqs, cfg.tokens_per_batch, cfg.max_len, torch.arange(len(seqs))):
        chosen = [seqs[i] for i in group]
        regions = [
            Region(i, t, min(cfg.k_max, min(len(s.tokens), cfg.max_len) - t))
            for i, s in enumerate(chosen)
            for t in range(s.prompt_len - 1, min(len(s.tokens), cfg.max_len) - 2, cfg.val_stride)
        ]
        if regions:
            out.append(pack(chosen, regions, cfg.max_len))
    return out


def train_mask(job: TrainJob, cfg: MaskTrainConfig) -> dict:
    """Train and save a mask-token adapter in `job.out`; returns the report. `out` holds the latest
    validated adapter from the first validation on, so a stopped run ships."""
    seed_everything(cfg.loop.seed)
    started = time.perf_counter()
    base = job.target.model
    read = lambda holdout: [  # noqa: E731
        fitted(s, cfg.max_len) for s in training_sequences(job.data, cfg.holdout_every, holdout, hidden=False)
    ]
    train_seqs, held = read(False), read(True)
    val_seqs = held[:: max(1, len(held) // cfg.val_sequences)][: cfg.val_sequences]  # spread (a store: by length)
    if not train_seqs or not val_seqs:
        raise UserError(f"{job.data} holds too few sequences to train and validate on")
    spec = MaskSpec(
        base=job.target.name,
        vocab_size=base.config.vocab_size,
        hidden_size=base.config.hidden_size,
        rank=cfg.rank,
        alpha=cfg.alpha,
        gating=cfg.gating,
        trained_k=cfg.k_max,
    )
    if job.start_from is not None:
        view = load_mask_model(base, job.start_from)
        if view.mtp_mask_spec != spec:
            raise UserError(f"{job.start_from} was trained with other adapter settings")
    else:
        view = mask_model(base, spec, None)
    for p in base.parameters():
        p.requires_grad_(False)
    params = adapter_parameters(view)
    for p in params.values():
        p.requires_grad_(True)
    shared_prefix = cfg.gating == MASK_ONLY
    mask_id = spec.mask_token_id
    val_packs = validation_packs(val_seqs, cfg)
    heldout = []
    if cfg.heldout_per_category:  # the Spec-Bench answers, scored as the validation side is
        seqs = spec_bench_heldout(job.target, cfg.heldout_per_category, log=job.log)
        heldout = validation_packs([fitted(s, cfg.max_len) for s in seqs], cfg)

    def epoch_batches(epoch: int) -> list[tuple[list[Sequence], list[Region]]]:
        g = torch.Generator().manual_seed(cfg.loop.seed * 1000 + epoch)
        batches = []
        for group in packs(train_seqs, cfg.tokens_per_batch, cfg.max_len, torch.randperm(len(train_seqs), generator=g)):
            seqs = [train_seqs[i] for i in group]
            regions = sample_regions(seqs, cfg, g)
            if regions:  # a pack of answers too short to hold a region trains nothing
                batches.append((seqs, regions))
        return batches

    def loss_fn(batch) -> tuple[torch.Tensor, dict[str, float]]:
        seqs, regions = batch
        packed = pack(seqs, regions, cfg.max_len)
        logits, labels = student_and_teacher(view, packed, mask_id, shared_prefix, grad=True)
        loss = torch.nn.functional.cross_entropy(logits, labels)
        return loss, {"loss": loss.item(), "top1": float((logits.argmax(-1) == labels).float().mean())}

    def validated() -> dict[str, float]:
        view.eval()
        result = validate(view, val_packs, mask_id, shared_prefix)
        result |= as_heldout(validate(view, heldout, mask_id, shared_prefix)) if heldout else {}
        save_mask_model(view, job.out)  # the latest validated adapter is always the shipped one
        return result

    with stock_linears(view):
        initial = validate(view, val_packs, mask_id, shared_prefix)
        initial |= as_heldout(validate(view, heldout, mask_id, shared_prefix)) if heldout else {}
        job.log(f"mask model: {len(train_seqs)} training sequences, k_max {cfg.k_max}; before training: {initial}")
        history = job.train(params, epoch_batches, loss_fn, validated, cfg.loop)
    save_mask_model(view, job.out)
    adapter = sum(p.numel() for p in params.values())
    sizes = {"train_sequences": len(train_seqs), "val_sequences": len(val_seqs), "adapter_parameters": adapter}
    return job.report(cfg, started, initial, history, **sizes)
