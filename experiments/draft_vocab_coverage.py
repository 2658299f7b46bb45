"""How much of the held-out Spec-Bench answers' tokens a draft vocabulary holds (docs/training.md,
2026-12-07): the corpus's most frequent tokens (all, or answers only), the tokenizer's first ids,
and the shipped EAGLE-3 drafter's vocabulary. Counting only, no model:

    .venv/bin/python experiments/draft_vocab_coverage.py
"""

import collections
import json

from safetensors.torch import load_file

from mtp_viz.paths import ASSETS
from mtp_viz.training.corpus import VALIDATION, read_records

CORPUS = ASSETS / "corpus" / "smollm2-135m"
HELDOUT = ASSETS / "heldout" / "smollm2-135m-spec-bench-3x96.json"
SHIPPED = ASSETS / "eagle3" / "smollm2-135m-eagle3" / "model.safetensors"


def main() -> None:
    every, answers = collections.Counter(), collections.Counter()
    for r in read_records(CORPUS):
        if r["split"] != VALIDATION:
            every.update(r["prompt_ids"] + r["answer_ids"])
            answers.update(r["answer_ids"])
    held = [t for s in json.loads(HELDOUT.read_text())["sequences"] for t in s["answer_ids"]]

    def share(vocab) -> float:
        return sum(t in vocab for t in held) / len(held)

    t2d = load_file(str(SHIPPED))["t2d"].bool()
    print(f"{len(held)} held-out answer tokens; never in the corpus's answers: {1 - share(set(answers)):.3f}")
    print(f"the shipped drafter's: {share({t for t in range(len(t2d)) if t2d[t]}):.3f}")
    for size in (8192, 16384):
        print(f"corpus, all, {size}: {share({t for t, _ in every.most_common(size)}):.3f}")
        print(f"corpus, answers, {size}: {share({t for t, _ in answers.most_common(size)}):.3f}")
    for size in (8192, 16384, 24576):
        print(f"the tokenizer's first {size} ids: {share(set(range(size))):.3f}")


if __name__ == "__main__":
    main()
