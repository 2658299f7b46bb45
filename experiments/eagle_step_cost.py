"""Where a corpus-scale EAGLE-3 training step's time goes (docs/training.md, 2026-12-07): the
target's view of a batch (Unseen.ready) against the drafter's forward and its backward and update,
on the first 400 records of the repository's corpus, three batches of ~BUDGET padded tokens:

    OMP_NUM_THREADS=1 .venv/bin/python experiments/eagle_step_cost.py [BUDGET [PROMPT_WEIGHT]]  # 1024, 0
"""

import random
import sys
import time

import torch

from mtp_viz.drafters.vocab import frequent_tokens
from mtp_viz.loading import load_model
from mtp_viz.training.corpus import read_records
from mtp_viz.training.draft import batches_of
from mtp_viz.training.eagle import build_drafter, losses, trained_parameters
from mtp_viz.training.eagle_examples import EagleTrainConfig, collate, corpus_examples, record_vocab_tokens

BUDGET = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
target = load_model("smollm2-135m", "cpu", "float32")
model = target.model.requires_grad_(False)
recs = [r for r in read_records(__import__("pathlib").Path("assets/corpus/smollm2-135m"))][:400]
vocab = frequent_tokens((record_vocab_tokens(r, "all") for r in recs), 8192, always=sorted(target.eos_token_ids))
layers = (2, 15, 27)
drafter = build_drafter(model, layers, vocab)
drafter.train()
cfg = EagleTrainConfig(prompt_weight=float(sys.argv[2]) if len(sys.argv) > 2 else 0.0)
exs = corpus_examples(recs, model, layers, drafter.to_draft_index(), cfg)
opt = torch.optim.AdamW(trained_parameters(drafter).values(), lr=1e-4)
for group in batches_of(exs, BUDGET, random.Random(0))[:3]:
    t0 = time.perf_counter()
    batch = collate(group)
    t1 = time.perf_counter()
    loss, _ = losses(drafter, batch, cfg)
    t2 = time.perf_counter()
    opt.zero_grad()
    loss.backward()
    opt.step()
    t3 = time.perf_counter()
    n = int((batch["weight"] > 0).sum())
    fwd = sum(len(e.ids) for e in group)
    print(
        f"B={tuple(batch['tokens'].shape)} trained {n} forward tokens {fwd}: target {t1 - t0:.2f} s, "
        f"drafter forward {t2 - t1:.2f} s, backward and update {t3 - t2:.2f} s",
        flush=True,
    )
