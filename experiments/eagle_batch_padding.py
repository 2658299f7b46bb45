"""How much of an EAGLE-3 epoch's chain work is padding, batched by window length (every chain) or
by answer length (`chain_batches`, prompts unweighted): counted on a feature store's training side
with the trainer's own batching, no model run (docs/training.md, tenth session).

    .venv/bin/python experiments/eagle_batch_padding.py [STORE]
"""

import random
import sys
from pathlib import Path

import torch

from mtp_viz.paths import cache_root
from mtp_viz.training.draft import batches_of
from mtp_viz.training.eagle_examples import EagleTrainConfig, chain_batches, store_examples
from mtp_viz.training.features import FeatureStore


def report(name: str, groups: list[list]) -> None:
    chains = sorted(sum(e.answer for e in g) for g in groups)
    padded = sum(len(g) * max(e.answer for e in g) for g in groups)
    windows = sum(len(g) * max(len(e.tokens) for e in g) for g in groups)
    q = lambda f: chains[int(f * (len(chains) - 1))]  # noqa: E731
    print(
        f"{name}: {len(groups)} steps, chain positions computed {padded:,} for {sum(chains):,} real "
        f"({1 - sum(chains) / padded:.1%} padding), window positions {windows:,}; real chains a step "
        f"5/25/50/75/95%: {q(0.05)} {q(0.25)} {q(0.5)} {q(0.75)} {q(0.95)}"
    )


def main() -> None:
    store = FeatureStore(Path(sys.argv[1]) if len(sys.argv) > 1 else cache_root() / "features" / "smollm2-135m")
    cfg = EagleTrainConfig()
    layers = tuple(store.meta["made_from"]["config"]["aux_layers"][:3])
    exs = store_examples(store, layers, torch.arange(1), cfg, validation=False)
    report("by window length", batches_of(exs, cfg.tokens_per_batch, random.Random(0)))
    report("by answer length", chain_batches(exs, cfg.tokens_per_batch, random.Random(0)))


if __name__ == "__main__":
    main()
