"""The target's view of every corpus position, computed once by teacher-forced forwards and kept
memory-mapped, so a drafter's training reads a million tokens without holding them in RAM.

From a corpus (mtp_viz.training.corpus) a store holds, for the N tokens of its S sequences
(prompt then answer; stored shortest first, `record` giving each one's place in the corpus):
- `tokens` (N,) int32, `starts` (S+1,) int64 (sequence s is tokens[starts[s]:starts[s+1]]),
  `prompt_len` (S,) int32, `validation` (S,) bool (the corpus's split);
- `argmax` (N,) int32: the target's argmax for the next token (−1 at a sequence's last position);
- `topk_ids` (N, K) int32, `topk_logp` (N, K) float16: its top-K next-token log-probabilities;
- `hidden` (N, H) float16: the final hidden state (after the norm: what the head reads; the heads
  and the draft model learn from it);
- `aux` (N, A·H) float16: the residual streams entering the `aux_layers` (EAGLE-3's inputs, as
  vLLM and mtp_viz.training.eagle read them).
Sequences are computed in batches of about BATCH_TOKENS tokens (similar lengths together, right
padded, causal: padding never reaches a real position) and written straight into the maps; `meta.json`
says how far it got, so a stopped build resumes there, and what the store was made from.
"""

import json
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from mtp_viz.drafters.eagle3_config import default_aux_layer_ids
from mtp_viz.errors import UserError
from mtp_viz.measured import stamp, write_atomically
from mtp_viz.training.corpus import VALIDATION, read_records
from mtp_viz.training.data import Sequence, load_sequences

META, VERSION = "meta.json", 1
BATCH_TOKENS = 4096  # tokens (padding included) a teacher-forced forward takes at once
ARRAYS = ("tokens", "argmax", "topk_ids", "topk_logp", "hidden", "aux")


@dataclass(frozen=True)
class FeatureConfig:
    aux_layers: tuple[int, ...]
    top_k: int = 16
    max_tokens: int = 2048  # a longer sequence is cut at the end (its prompt kept)
    sequences: int = 0  # a seeded random share of the corpus's sequences, this many (0: all): a store
    # for runs at a shorter budget (the ablations) costs its share of the full store's ~2 h


def store_layers(num_layers: int) -> tuple[int, ...]:
    """The aux layers a store keeps by default: vLLM's EAGLE-3 default (2, L/2, L−3) and the last
    layer's input (L−1), so the layer ablation (2, L/2, L−1) trains from the same store."""
    return tuple(sorted({*default_aux_layer_ids(num_layers), num_layers - 1}))


def is_store(folder: Path) -> bool:
    """Whether `folder` holds a feature store (finished or not)."""
    return (folder / META).is_file()


class FeatureStore:
    """A store's arrays as memory maps (torch tensors over them on demand; the files are never written)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.meta = json.loads((folder / META).read_text())
        if not self.meta.get("complete"):
            raise UserError(f"the features in {folder} are not finished; build them again to resume")
        self.starts = np.load(folder / "starts.npy")
        self.prompt_len = np.load(folder / "prompt_len.npy")
        self.validation = np.load(folder / "validation.npy")
        self.arrays = {name: _open(folder, name, "c") for name in ARRAYS}  # copy-on-write: torch wants writable

    def __len__(self) -> int:
        return len(self.prompt_len)

    def sequence(self, s: int) -> dict[str, torch.Tensor]:
        """Sequence s's arrays (views: nothing is read until used)."""
        a, b = int(self.starts[s]), int(self.starts[s + 1])
        return {name: torch.from_numpy(np.asarray(arr[a:b])) for name, arr in self.arrays.items()}

    def indices(self, validation: bool) -> list[int]:
        return [s for s in range(len(self)) if bool(self.validation[s]) == validation]


def store_sequence(store: FeatureStore, s: int) -> Sequence:
    """Sequence s as the trainers of cached data read one (views of the store's arrays: the records
    of the positions that have a next token), its EAGLE-3 features left in the store."""
    seq = store.sequence(s)
    labels = (seq["hidden"][:-1], seq["argmax"][:-1], seq["topk_ids"][:-1], seq["topk_logp"][:-1])
    return Sequence(seq["tokens"], int(store.prompt_len[s]), *labels)


def training_sequences(data: Path, holdout_every: int, holdout: bool, hidden: bool = True) -> Iterator[Sequence]:
    """The sequences a trainer reads from `data`: a feature store's side of its split (the corpus's
    validation by source; `holdout_every` does not apply), read in place, or the older cached
    set's every n-th sequence (or all but those). hidden=False leaves the final hidden states out."""
    if not is_store(data):
        yield from load_sequences(data, holdout_every, holdout, hidden)
        return
    store = FeatureStore(data)
    for s in store.indices(validation=holdout):
        seq = store_sequence(store, s)
        yield seq if hidden else replace(seq, hidden=None)


def _open(folder: Path, name: str, mode: str, shape: tuple | None = None, dtype=None) -> np.memmap:
    meta = json.loads((folder / META).read_text())["arrays"][name] if shape is None else None
    shape = tuple(meta["shape"]) if meta else shape
    dtype = np.dtype(meta["dtype"]) if meta else dtype
    return np.lib.format.open_memmap(folder / f"{name}.npy", mode=mode, dtype=dtype, shape=shape)


def build(model, corpus: Path, folder: Path, cfg: FeatureConfig, stop_after: int | None = None) -> Path:
    """The store of `corpus` under `model` (an nn.Module on its device) in `folder`, built or
    finished; `stop_after` stops after that many sequences (tests of resuming)."""
    records = list(read_records(corpus))
    chosen = range(len(records))
    if 0 < cfg.sequences < len(records):  # drawn whatever the split: each side keeps its share
        chosen = random.Random(0).sample(chosen, cfg.sequences)
    order = sorted(chosen, key=lambda i: len(records[i]["prompt_ids"]) + len(records[i]["answer_ids"]))
    records = [records[i] for i in order]  # by length: a batch's sequences pad little
    seqs = [(r["prompt_ids"] + r["answer_ids"])[: cfg.max_tokens] for r in records]
    starts = np.zeros(len(seqs) + 1, dtype=np.int64)
    starts[1:] = np.cumsum([len(s) for s in seqs])
    n, hidden, k = int(starts[-1]), model.config.hidden_size, cfg.top_k
    made_from = {"corpus": str(corpus), "sequences": len(seqs), "tokens": n, "config": asdict(cfg)}
    made_from = json.loads(json.dumps(made_from))  # as it reads back (tuples are lists in JSON)
    folder.mkdir(parents=True, exist_ok=True)
    meta = _meta(folder, made_from)
    shapes = {
        "tokens": ((n,), np.int32),
        "argmax": ((n,), np.int32),
        "topk_ids": ((n, k), np.int32),
        "topk_logp": ((n, k), np.float16),
        "hidden": ((n, hidden), np.float16),
        "aux": ((n, hidden * len(cfg.aux_layers)), np.float16),
    }
    if meta["done"] == 0:
        meta["arrays"] = {name: {"shape": list(s), "dtype": np.dtype(d).name} for name, (s, d) in shapes.items()}
        np.save(folder / "starts.npy", starts)
        np.save(folder / "prompt_len.npy", np.array([min(len(r["prompt_ids"]), cfg.max_tokens) for r in records]))
        np.save(folder / "validation.npy", np.array([r["split"] == VALIDATION for r in records]))
        np.save(folder / "record.npy", np.array(order, dtype=np.int64))  # the corpus's order of each sequence
        arrays = {name: _open(folder, name, "w+", s, d) for name, (s, d) in shapes.items()}
        _save(folder, meta)
    else:
        arrays = {name: _open(folder, name, "r+") for name in ARRAYS}
    done = meta["done"]
    with torch.inference_mode(), tqdm(total=len(seqs), initial=done, desc="features", unit="seq") as bar:
        for batch in _batches(list(range(done, len(seqs))), seqs):
            if stop_after is not None and done - meta["done"] >= stop_after:
                break
            _forward(model, [seqs[s] for s in batch], [int(starts[s]) for s in batch], arrays, cfg)
            for arr in arrays.values():
                arr.flush()
            done = batch[-1] + 1
            _save(folder, {**meta, "done": done})  # what is on disk now
            bar.update(len(batch))
    complete = done == len(seqs)
    _save(
        folder,
        {**meta, "done": done, "complete": complete, **({"finished_at": stamp(time.time())} if complete else {})},
    )
    return folder


def _batches(todo: list[int], seqs: list[list[int]]) -> list[list[int]]:
    """Consecutive sequences (so `done` counts a prefix), shortest first, grouped up to BATCH_TOKENS
    padded tokens."""
    out: list[list[int]] = []
    for s in todo:
        if out and (len(out[-1]) + 1) * len(seqs[s]) <= BATCH_TOKENS:  # shortest first: s is the longest
            out[-1].append(s)
        else:
            out.append([s])
    return out


@dataclass(frozen=True)
class TargetView:
    """The target's view of a right-padded batch (B, T): what a store keeps of each position."""

    final: torch.Tensor  # (B, T, H): the final hidden state, after the norm
    aux: torch.Tensor  # (B, T, A·H): the residual streams entering the aux layers
    top_ids: torch.Tensor  # (B, T, K): top-K next-token ids (argmax first)
    top_logp: torch.Tensor  # (B, T, K): their log-probabilities


def target_view(
    model, batch: list[list[int]], aux_layers: tuple[int, ...], top_k: int, labelled_from: int = 0
) -> TargetView:
    """One teacher-forced forward of `batch` (token lists, right padded: causal, so padding never
    reaches a real position), with the checks a float16 copy needs. The head reads positions from
    `labelled_from` on (those a loss reads); earlier ones get id 0 at log-probability −inf."""
    length = max(len(s) for s in batch)
    device = next(model.parameters()).device
    ids = torch.zeros(len(batch), length, dtype=torch.long)
    for r, s in enumerate(batch):
        ids[r, : len(s)] = torch.tensor(s)
    out = model.model(input_ids=ids.to(device), output_hidden_states=True)
    final = out.last_hidden_state  # (B, T, H), after the norm
    aux = torch.cat([out.hidden_states[i] for i in aux_layers], -1)  # layer i's input, as vLLM's EAGLE-3 reads
    logits = model.lm_head(final[:, labelled_from:]).float()
    top_logits, top_ids = torch.topk(logits, top_k, dim=-1)
    top_logp = top_logits - torch.logsumexp(logits, -1, keepdim=True)  # log-probabilities, one vocabulary pass
    del logits
    if labelled_from:
        top_ids = torch.nn.functional.pad(top_ids, (0, 0, labelled_from, 0))
        top_logp = torch.nn.functional.pad(top_logp, (0, 0, labelled_from, 0), value=-torch.inf)
    for name, x in (("hidden", final), ("aux", aux)):  # fp16 holds ±65504: an overflow would poison training
        if not torch.isfinite(x.half()).all():
            raise RuntimeError(f"the target's {name} states overflow float16 in this batch; the store cannot hold them")
    return TargetView(final, aux, top_ids, top_logp)


def _forward(model, batch: list[list[int]], offsets: list[int], arrays: dict, cfg: FeatureConfig) -> None:
    view = target_view(model, batch, cfg.aux_layers, cfg.top_k)
    for r, (s, at) in enumerate(zip(batch, offsets, strict=True)):
        m = len(s)
        arrays["tokens"][at : at + m] = np.asarray(s, dtype=np.int32)
        argmax = view.top_ids[r, :m, 0].int().cpu().numpy().copy()
        argmax[-1] = -1  # no next token to predict at the last position
        arrays["argmax"][at : at + m] = argmax
        arrays["topk_ids"][at : at + m] = view.top_ids[r, :m].int().cpu().numpy()
        arrays["topk_logp"][at : at + m] = view.top_logp[r, :m].half().cpu().numpy()
        arrays["hidden"][at : at + m] = view.final[r, :m].half().cpu().numpy()
        arrays["aux"][at : at + m] = view.aux[r, :m].half().cpu().numpy()


def _meta(folder: Path, made_from: dict) -> dict:
    path = folder / META
    if path.is_file():
        meta = json.loads(path.read_text())
        if meta.get("version") != VERSION or meta.get("made_from") != made_from:
            raise UserError(f"{folder} holds features of another corpus or settings; pick another folder")
        return meta
    return {"version": VERSION, "made_from": made_from, "done": 0, "complete": False}


def _save(folder: Path, meta: dict) -> None:
    text = json.dumps(meta, indent=1)
    write_atomically(folder / META, lambda tmp: tmp.write_text(text), what="the feature store's progress")
