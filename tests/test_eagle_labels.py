"""EAGLE-3's training labels line up with the target: at every chain base i and step j, what the
unrolled drafter reads (token i + j, the features of position i) and what it is scored against
(the target's next token after tokens[: i + j + 1]) are what a direct forward of the tiny target
gives, for every road into training: a corpus's feature store, the corpus itself and the held-out
answers."""

import numpy as np
import pytest
import torch

from mtp_viz.loading import load_model
from mtp_viz.training import eagle, eagle_unroll
from mtp_viz.training.corpus import CorpusConfig, read_records
from mtp_viz.training.corpus_make import OURS, make
from mtp_viz.training.eagle_examples import corpus_examples
from mtp_viz.training.features import FeatureConfig, FeatureStore, build
from mtp_viz.training.heldout import answer

LAYERS = (0, 1)
STEPS = 3


@pytest.fixture
def target(use_tiny_registry):
    return load_model("tiny")


def direct(model, tokens: torch.Tensor):
    """The target's argmax after every prefix, its runner-up margin and the aux-layer features."""
    with torch.inference_mode():
        out = model.model(input_ids=tokens[None].long(), output_hidden_states=True)
        logits = model.lm_head(out.last_hidden_state)[0].float()
    top = logits.topk(2, -1)
    features = torch.cat([out.hidden_states[k][0] for k in LAYERS], -1)
    return top.indices[:, 0], top.values[:, 0] - top.values[:, 1], features


# a corpus of every first-turn source and a second turn, both sides of the split
SMALL = CorpusConfig(
    templates=3, code=1, documents=1, math=1, chat=1, subjects=0, max_new_tokens=6, validation_share=0.4
)


def check(model, examples: list[eagle.Example], prompt_lens: list[int], cfg: eagle.EagleTrainConfig) -> int:
    checked = 0
    for ex, prompt_len in zip(examples, prompt_lens, strict=True):
        batch = eagle.collate([ex])
        n = len(ex.tokens)
        t = n - 1
        argmax, margin, features = direct(model, ex.tokens)
        torch.testing.assert_close(batch["features"][0].float(), features, atol=2e-2, rtol=1e-2)
        for j in range(1, STEPS + 1):
            labels, _, _, weight = eagle_unroll.step_labels(batch, j, torch.arange(t)[None])
            read = torch.nn.functional.pad(batch["tokens"], (0, j))[0, j : j + t]  # as unroll feeds step j
            for i in range(t):
                if i + j > n - 2:  # past the last token: no label
                    assert labels[0, i] == -1 and weight[0, i] == 0
                    continue
                assert read[i] == ex.tokens[i + j]
                if margin[i + j] > 1e-3 and weight[0, i] > 0:  # the labels a loss reads (a prompt's may be left out)
                    assert labels[0, i] == argmax[i + j], (i, j)
                    checked += 1
                assert weight[0, i] == (1.0 if i + j >= prompt_len - 1 else cfg.prompt_weight)
    return checked


def test_labels_from_a_feature_store_are_the_targets_next_tokens(target, tmp_path):
    corpus, _ = make("tiny", tmp_path / "corpus", SMALL, OURS)
    store = FeatureStore(build(target.model, corpus, tmp_path / "f", FeatureConfig(aux_layers=LAYERS)))
    identity = torch.arange(target.model.config.vocab_size)
    train_cfg = eagle.EagleTrainConfig()
    order = store.indices(False) + store.indices(True)
    exs = [e for split in (False, True) for e in eagle.store_examples(store, LAYERS, identity, train_cfg, split)]
    assert check(target.model, exs, [int(store.prompt_len[s]) for s in order], train_cfg) > 50


def test_labels_of_the_heldout_answers_are_the_targets_next_tokens(target):
    seqs = answer(target, ["Say something.", "Count to ten, please."], max_new_tokens=8)
    identity = torch.arange(target.model.config.vocab_size)
    train_cfg = eagle.EagleTrainConfig()
    exs = eagle.sequence_examples(target.model, seqs, LAYERS, identity, train_cfg)
    assert check(target.model, exs, [s.prompt_len for s in seqs], train_cfg) > 10


def test_labels_straight_from_a_corpus_are_the_targets_next_tokens(target, tmp_path):
    """The third road: a corpus's records, the target's view computed when a batch is collated."""
    corpus, _ = make("tiny", tmp_path / "corpus", SMALL, OURS)
    records = list(read_records(corpus))
    identity = torch.arange(target.model.config.vocab_size)
    train_cfg = eagle.EagleTrainConfig()
    pending = corpus_examples(records, target.model, LAYERS, identity, train_cfg)
    exs = [p.ready() for p in pending]
    assert check(target.model, exs, [len(r["prompt_ids"]) for r in records], train_cfg) > 50


def test_a_corpus_record_becomes_the_example_its_stored_sequence_becomes(target, tmp_path):
    """The corpus road and the store road give one record the same example, cut to the training
    window (a window shorter than the tiny sequences, so the cut is exercised)."""
    corpus, _ = make("tiny", tmp_path / "corpus", SMALL, OURS)
    store = FeatureStore(build(target.model, corpus, tmp_path / "f", FeatureConfig(aux_layers=LAYERS)))
    records, picked = list(read_records(corpus)), np.load(tmp_path / "f" / "record.npy")
    identity = torch.arange(target.model.config.vocab_size)
    train_cfg = eagle.EagleTrainConfig(max_tokens=12)
    train_side = eagle.store_examples(store, LAYERS, identity, train_cfg, False)
    stored = {int(picked[s]): p for s, p in zip(store.indices(False), train_side, strict=True)}
    unseen = corpus_examples(records, target.model, LAYERS, identity, train_cfg)
    assert stored and all(len(records[r]["prompt_ids"]) + len(records[r]["answer_ids"]) > 12 for r in stored)
    for r, pending in stored.items():
        a, b = pending.ready(), unseen[r].ready()
        assert len(a.tokens) == len(b.tokens) == 12 and torch.equal(a.tokens, b.tokens)
        assert torch.equal(a.weight, b.weight)
        torch.testing.assert_close(a.features.float(), b.features.float(), atol=2e-2, rtol=1e-2)
        read = a.weight > 0  # the labels a loss reads (the corpus road computes no others)
        assert read.any() and (a.argmax == b.argmax)[read].float().mean() >= 0.9  # a near-tie may fall either way
        torch.testing.assert_close(a.topk_p[read], b.topk_p[read], atol=2e-2, rtol=1e-2)
