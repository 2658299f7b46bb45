"""The fixed held-out set every drafter is judged on: the target's greedy answers to the first
prompts of each Spec-Bench category (3 per category, 96 tokens: 39 answers for the embedded
model), with its view of every position (argmax, top-k) from a teacher-forced forward. No
Spec-Bench prompt is in any training data (the corpus drops its overlaps), so agreement here is
agreement on new prompts.

The token ids are fixed where they ship (assets/heldout/<target>-spec-bench-<n>x<tokens>.json: the
embedded model's, answered on a 2-core AMD EPYC), else made once and cached
(<cache>/heldout/<target>-<hash of its name, source and weights>/); the target's view of them is
computed where it runs, so labels are this machine's target's.
"""

import hashlib
import json
from pathlib import Path

import torch

from mtp_viz.loading import LoadedModel, encode_prompt
from mtp_viz.measured import write_atomically
from mtp_viz.paths import ASSETS, cache_root
from mtp_viz.prompts import spec_bench
from mtp_viz.sampling import Warp
from mtp_viz.training.data import DataConfig, Sequence, generate_batch, teacher_record

PER_CATEGORY = 3
MAX_NEW_TOKENS = 96
MAX_PROMPT_TOKENS = 700  # a longer prompt keeps its last 700 tokens
BATCH = 8
SHIPPED = ASSETS / "heldout"


def spec_bench_prompts(per_category: int = PER_CATEGORY) -> list[str]:
    """The first `per_category` first turns of every Spec-Bench category, in the file's order."""
    by_category: dict[str, list[str]] = {}
    for q in spec_bench():
        by_category.setdefault(q["category"], []).append(q["turns"][0])
    return [p for ps in by_category.values() for p in ps[:per_category]]


@torch.inference_mode()
def answer(target: LoadedModel, prompts: list[str], max_new_tokens: int = MAX_NEW_TOKENS) -> list[Sequence]:
    """The target's greedy answers to `prompts`, decoded in batches, with its view of each position."""
    ids = [encode_prompt(target, p)[-MAX_PROMPT_TOKENS:] for p in prompts]
    cfg = DataConfig(max_new_tokens=max_new_tokens)
    seqs: list[Sequence] = []
    for start in range(0, len(ids), BATCH):
        seqs += generate_batch(target, ids[start : start + BATCH], cfg, Warp(), torch.Generator().manual_seed(0))
    return seqs


def spec_bench_heldout(
    target: LoadedModel, per_category: int = PER_CATEGORY, max_new_tokens: int = MAX_NEW_TOKENS, log=print
) -> list[Sequence]:
    """The held-out set for `target`: its token ids (shipped, cached, or answered here once) with
    the target's view of every position."""
    name = f"spec-bench-{per_category}x{max_new_tokens}"
    shipped = SHIPPED / f"{Path(target.name).name}-{name}.json"
    identity = hashlib.sha1(f"{target.name}|{target.source}|{target.weights}".encode()).hexdigest()[:12]
    cached = cache_root() / "heldout" / f"{Path(target.name).name}-{identity}" / f"{name}.json"
    path = shipped if shipped.is_file() else cached
    if not path.is_file():
        log(f"held-out set: the target's answers to {per_category} Spec-Bench prompts a category (once, {path})")
        seqs = answer(target, spec_bench_prompts(per_category), max_new_tokens)
        records = [
            {"prompt_ids": s.tokens[: s.prompt_len].tolist(), "answer_ids": s.tokens[s.prompt_len :].tolist()}
            for s in seqs
        ]
        made = {"model": target.name, "weights": target.weights, "sequences": records}
        write_atomically(path, lambda tmp: tmp.write_text(json.dumps(made)), "the held-out set")
    records = json.loads(path.read_text())["sequences"]
    return [teacher_view(target.model, r["prompt_ids"], r["answer_ids"]) for r in records]


def as_heldout(scores: dict[str, float]) -> dict[str, float]:
    """A trainer's validation scores of the held-out set, named as such (val_x → heldout_x): every
    trainer reports them beside its own validation, so drafters compare on the same answers."""
    return {"heldout_" + k.removeprefix("val_"): v for k, v in scores.items()}


@torch.inference_mode()
def teacher_view(model, prompt_ids: list[int], answer_ids: list[int]) -> Sequence:
    """A prompt and answer with the target's view of every position that has a next token, recorded
    as the self-distillation set records it (data.teacher_record)."""
    tokens = torch.tensor(prompt_ids + answer_ids, dtype=torch.int32)
    ids = tokens[None].long().to(next(model.parameters()).device)
    hidden = model.model(input_ids=ids).last_hidden_state[0, :-1]
    record = teacher_record(model, hidden, None, DataConfig().teacher_top_k)
    return Sequence(tokens, len(prompt_ids), *(x.cpu() for x in record))  # on the CPU, as training data is
