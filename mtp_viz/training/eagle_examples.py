"""What EAGLE-3 training reads (mtp_viz.training.eagle): its settings, and each sequence as an
Example: the tokens it reads, the target's features at its aux layers, and the labels it is scored
against in draft ids, from a corpus's feature store, straight from a corpus (the target's view
computed batch by batch: no store), from the older self-distillation set (features computed once
and cached beside it) or from sequences at hand (the held-out set). A store's sequences (Pending)
and a corpus's records (Unseen: their token ids only) become examples only when a batch is
collated, so RAM stays flat however large the corpus but for the ids; a store may hold more aux
layers than a drafter reads (the layer ablation trains from one store).

Store or corpus: a store costs one teacher-forced pass over the corpus up front (about 2 h for
2.35M tokens on a 2-core CPU) and GBs on disk, then every epoch reads it; training straight from
the corpus pays that pass again each epoch but needs no disk and starts at once, and its run can
be continued on another machine from the drafter it saved (mtp_viz.training.loop's restart).
"""

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mtp_viz.errors import UserError
from mtp_viz.training.data import Sequence, load_sequences, shards
from mtp_viz.training.draft import batches_of
from mtp_viz.training.features import FeatureConfig, FeatureStore, store_sequence, target_view
from mtp_viz.training.heldout import PER_CATEGORY
from mtp_viz.training.loop import LoopConfig

FEATURES = "features"  # the cached target features, per aux-layer choice: data/features/<ids>/<shard>.pt


@dataclass(frozen=True)
class EagleTrainConfig:
    ttt_steps: int = 5  # also the deepest chain the strategy drafts with it (config.json's trained_draft_steps)
    reduced_vocab: int = 8192
    aux_layers: tuple[int, ...] | None = None  # None: vLLM's default (2, L/2, L−3)
    max_tokens: int = 640  # a longer sequence keeps its last max_tokens
    tokens_per_batch: int = 4096  # padded positions a step trains: its chains (prompt unweighted), else its windows
    step_decay: float = 0.8
    soft_weight: float = 0.5
    prompt_weight: float = 0.0  # 0: only chains from a prompt's end on are computed (the shipped drafter: 0.2)
    holdout_every: int = 20
    heldout_per_category: int = PER_CATEGORY  # Spec-Bench answers scored at every validation (0: none)
    # an RMSNorm over the concatenated features before `fc`: None, a fresh drafter has it (it won the
    # ablations, docs/training.md) and a trained one (--start-from) keeps its own; True adds it to one
    norm_before_fc: bool | None = None
    regression_weight: float = 0.0  # smooth-L1 of each step's normed state to the target's (EAGLE-1's term)
    frozen_head_steps: int = 0  # the head (initialised from the target's rows) frozen for this many steps
    vocab_from: str = "answers"  # the draft vocabulary from the answers' tokens (the ablations' winner) or all
    val_tokens: int = 65536  # a store's validation side scored at every evaluation: sequences spread over it
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

    def ready(self) -> "Example":
        return self

    @property
    def answer(self) -> int:
        """Its positions from the prompt's last on (answer labels, weight 1, and the last position)."""
        return int((self.weight == 1.0).sum()) + 1


@dataclass(frozen=True)
class Pending:
    """A store's sequence, made an Example only when collated: its arrays stay memory-mapped
    until then. `pick`: which of the store's aux layers (blocks of `features`) the drafter reads."""

    seq: Sequence
    features: torch.Tensor  # (n, A_store·H) view
    pick: tuple[int, ...]
    blocks: int  # A_store
    index: torch.Tensor
    cfg: "EagleTrainConfig"

    @property
    def tokens(self) -> torch.Tensor:
        """The tokens it trains on (its last max_tokens, as the Example keeps): what batches are sized by."""
        return self.seq.tokens[-self.cfg.max_tokens :]

    @property
    def answer(self) -> int:
        """Its window's positions from the prompt's last on: the chains a loss unrolls (prompt unweighted)."""
        return in_window(len(self.seq.tokens), self.seq.prompt_len, self.cfg.max_tokens)

    def ready(self) -> Example:
        h, kept = self.features.shape[1] // self.blocks, self.features[-self.cfg.max_tokens :]  # read no more
        features = torch.cat([kept[:, i * h : (i + 1) * h] for i in self.pick], -1)
        return example(self.seq, features, self.index, self.cfg)


@dataclass(frozen=True, eq=False)
class Unseen:
    """A corpus record, made an Example only when collated: one teacher-forced forward of the
    target over its whole sequence (prompt then answer, cut as a store cuts it) gives its labels
    and the features the drafter reads (its last max_tokens positions)."""

    ids: list[int]
    prompt_len: int
    tokens: torch.Tensor  # (n,) the tokens it trains on (its last max_tokens): what batches are sized by
    model: torch.nn.Module
    layers: tuple[int, ...]
    index: torch.Tensor
    cfg: "EagleTrainConfig"

    @property
    def answer(self) -> int:
        """Its window's positions from the prompt's last on: the chains a loss unrolls (prompt unweighted)."""
        return in_window(len(self.ids), self.prompt_len, self.cfg.max_tokens)

    def ready(self) -> Example:
        # labels only where a loss or a score reads them: in the window, and from the prompt's last position
        first = max(0, len(self.ids) - self.cfg.max_tokens, self.prompt_len - 1 if self.cfg.prompt_weight == 0 else 0)
        with torch.no_grad():  # not inference_mode: the features enter the drafter's autograd graph
            view = target_view(self.model, [self.ids], self.layers, FeatureConfig(self.layers).top_k, first)
        top_ids, top_logp = view.top_ids[0, :-1].int().cpu(), view.top_logp[0, :-1].half().cpu()
        tokens = torch.tensor(
            self.ids, dtype=torch.int32
        )  # an example is made on the CPU, whatever the target's device
        seq = Sequence(tokens, self.prompt_len, view.final[0, :-1].half().cpu(), top_ids[:, 0], top_ids, top_logp)
        kept = view.aux[0, -self.cfg.max_tokens :].half().cpu().clone()  # not a view of all its positions
        return example(seq, kept, self.index, self.cfg)


def in_window(n: int, prompt_len: int, window: int) -> int:
    """The positions of a sequence's last `window` (of n) from its prompt's last position on."""
    kept = min(n, window)
    return kept - min(kept, max(0, prompt_len - 1 - (n - kept)))


WINDOW_ROOM = 4  # chains batched by answer: a batch's windows may pad to this many times its chain budget


def by_answer(item: Example | Pending | Unseen) -> tuple[int, int]:
    """A batch order for chains unrolled from the prompt's end (eagle_unroll.chain_bases): rows with
    answers of a length together, so a batch's chain width pads little (grouping by the window's
    length left 14.5% of the chain positions an epoch of the corpus computed padding)."""
    return item.answer, len(item.tokens)


def chain_batches(items: list, chains_per_batch: int, rng) -> list[list]:
    """Batches of rows × the longest answer ≤ `chains_per_batch` (the chains a loss unrolls, so
    every step trains about as many), their windows ≤ WINDOW_ROOM × that, in shuffled order."""
    limits = [(lambda e: e.answer, chains_per_batch)]
    return batches_of(items, WINDOW_ROOM * chains_per_batch, rng, by_answer, limits)


def corpus_examples(
    records: list[dict], model, layers: tuple[int, ...], index: torch.Tensor, cfg: "EagleTrainConfig"
) -> list[Unseen]:
    """A corpus's records (one side of its split) as examples to be made when collated."""
    cut = FeatureConfig(layers).max_tokens
    out = []
    for r in records:
        ids = (r["prompt_ids"] + r["answer_ids"])[:cut]
        kept = torch.tensor(ids[-cfg.max_tokens :])
        out.append(Unseen(ids, min(len(r["prompt_ids"]), cut), kept, model, layers, index, cfg))
    return out


def record_vocab_tokens(record: dict, source: str) -> torch.Tensor:
    """vocab_tokens for a corpus record, whose target argmaxes are not known before its forward:
    its tokens (the answers are mostly the target's greedy choices), all or the answer's only."""
    if source not in ("all", "answers"):
        raise UserError(f"vocab_from {source!r}: all or answers")
    ids = record["answer_ids"] if source == "answers" else record["prompt_ids"] + record["answer_ids"]
    return torch.tensor(ids, dtype=torch.long)


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
    ids = tokens[None].long().to(next(model.parameters()).device)
    states = model.model(input_ids=ids, output_hidden_states=True).hidden_states  # no head
    return torch.cat([states[k][0] for k in aux_layers], -1).half().cpu()


def sequence_examples(model, seqs: list[Sequence], layers, index: torch.Tensor, cfg: EagleTrainConfig) -> list[Example]:
    """Sequences with the teacher's view (the held-out set) as examples, their features computed here."""
    return [example(s, aux_features(model, s.tokens, layers), index, cfg) for s in seqs]


def examples(data: Path, folder: Path, index: torch.Tensor, cfg: EagleTrainConfig, holdout: bool) -> list[Example]:
    """The training (or held-out: every `holdout_every`-th) sequences with their features, labels in draft ids."""
    features = [f for shard in shards(data) for f in torch.load(folder / shard.name)]
    chosen = zip(load_sequences(data, hidden=False), features, strict=True)
    return [example(s, f, index, cfg) for i, (s, f) in enumerate(chosen) if (i % cfg.holdout_every == 0) == holdout]


def store_examples(
    store: FeatureStore, layers: tuple[int, ...], index: torch.Tensor, cfg: EagleTrainConfig, validation: bool
) -> list[Pending]:
    """The store's training (or validation: the corpus's split, by source) sequences, to become
    examples when collated, reading `layers` of the store's aux layers; the validation side is
    cut to about `cfg.val_tokens` tokens of sequences spread over it (every evaluation scores them)."""
    stored = tuple(store.meta["made_from"]["config"]["aux_layers"])
    if missing := [k for k in layers if k not in stored]:
        raise UserError(f"the features in {store.folder} hold aux layers {stored}, not {tuple(missing)}")
    pick = tuple(stored.index(k) for k in layers)
    chosen = store.indices(validation)
    if validation:
        trained = [min(int(store.starts[s + 1] - store.starts[s]), cfg.max_tokens) for s in chosen]
        chosen = spread(chosen, trained, cfg.val_tokens)  # by the tokens scored, as from a corpus
    return [Pending(store_sequence(store, s), store.sequence(s)["aux"], pick, len(stored), index, cfg) for s in chosen]


def spread(items: list[int], sizes: list[int], budget: int) -> list[int]:
    """Every k-th item, k the smallest stride whose share of the sizes fits about `budget`."""
    return items[:: max(1, -(-sum(sizes) // max(1, budget)))]


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
        features=features[-(n - cut) :],  # `features` may come cut already (Pending)
        argmax=argmax[cut:],
        topk_ids=torch.cat([ids, pad])[cut:],
        topk_p=torch.cat([p, torch.zeros(1, ids.shape[1])])[cut:],
        weight=weight[cut:],
    )


def on_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A collated batch moved to the drafter's device (examples are made, and batches collated, on the CPU)."""
    return {name: x.to(device, non_blocking=True) for name, x in batch.items()}


def collate(items: list[Example | Pending | Unseen]) -> dict[str, torch.Tensor]:
    """Right-padded batch tensors (padding has weight 0)."""
    exs = [item.ready() for item in items]
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
