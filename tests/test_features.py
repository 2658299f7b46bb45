"""The feature store (mtp_viz.training.features): the target's view of every corpus position from
batched teacher-forced forwards, memory-mapped, resumable: each sequence's arrays are what a
forward of that sequence alone gives, and a stopped build finishes to the same store."""

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from mtp_viz.cli import main
from mtp_viz.drafters.eagle3 import load_eagle3
from mtp_viz.drafters.eagle3_config import default_aux_layer_ids
from mtp_viz.errors import UserError
from mtp_viz.loading import load_model
from mtp_viz.training import features, heads
from mtp_viz.training.corpus import read_records
from mtp_viz.training.eagle_examples import EagleTrainConfig, collate, store_examples
from mtp_viz.training.features import FeatureConfig, FeatureStore, build


@pytest.fixture
def corpus(tiny_corpus):
    return tiny_corpus


def test_every_position_holds_what_a_forward_of_its_sequence_alone_gives(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(features, "BATCH_TOKENS", 600)  # several sequences a batch, several batches
    model = load_model("tiny").model
    store = FeatureStore(build(model, corpus, tmp_path / "f", FeatureConfig(aux_layers=(0, 1), top_k=4)))
    records = list(read_records(corpus))
    assert len(store) == len(records) and sorted(store.meta["made_from"].items())
    lengths = np.diff(store.starts)
    assert (lengths[:-1] <= lengths[1:]).all()  # shortest first
    for s in range(len(store)):
        seq, record = store.sequence(s), records[int(np.load(tmp_path / "f" / "record.npy")[s])]
        assert seq["tokens"].tolist() == record["prompt_ids"] + record["answer_ids"]
        with torch.inference_mode():
            out = model.model(input_ids=seq["tokens"][None].long(), output_hidden_states=True)
            logits = model.lm_head(out.last_hidden_state)[0].float()
        torch.testing.assert_close(seq["hidden"].float(), out.last_hidden_state[0], atol=2e-2, rtol=1e-2)
        aux = torch.cat([out.hidden_states[0][0], out.hidden_states[1][0]], -1)
        torch.testing.assert_close(seq["aux"].float(), aux, atol=2e-2, rtol=1e-2)
        top2 = logits.topk(2, -1)
        clear = (top2.values[:, 0] - top2.values[:, 1] > 1e-3)[:-1]
        assert (seq["argmax"][:-1][clear] == top2.indices[:-1, 0][clear].int()).all() and seq["argmax"][-1] == -1
        assert seq["topk_ids"].shape[1] == 4 and (seq["topk_logp"][:, 0] >= seq["topk_logp"][:, 1]).all()
    assert set(store.indices(True)) | set(store.indices(False)) == set(range(len(store)))


def test_a_stopped_build_resumes_and_is_refused_until_finished(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(features, "BATCH_TOKENS", 300)
    model = load_model("tiny").model
    cfg = FeatureConfig(aux_layers=(1,), top_k=2)
    build(model, corpus, tmp_path / "part", cfg, stop_after=3)
    with pytest.raises(UserError, match="not finished"):
        FeatureStore(tmp_path / "part")
    resumed = FeatureStore(build(model, corpus, tmp_path / "part", cfg))
    whole = FeatureStore(build(model, corpus, tmp_path / "whole", cfg))
    for name in ("tokens", "argmax", "topk_ids"):
        assert np.array_equal(resumed.arrays[name], whole.arrays[name]), name
    np.testing.assert_allclose(resumed.arrays["hidden"], whole.arrays["hidden"], atol=2e-2)
    with pytest.raises(UserError, match="another corpus or settings"):
        build(model, corpus, tmp_path / "whole", FeatureConfig(aux_layers=(0,), top_k=2))


def test_the_command_builds_the_store_of_a_finished_corpus_and_refuses_an_unfinished_one(corpus, tmp_path, capsys):
    assert main(["train", "features", "--model", "tiny", "--data", str(corpus), "--out", str(tmp_path / "f")]) == 0
    assert "features of" in capsys.readouterr().out
    store = FeatureStore(tmp_path / "f")
    layers = store.meta["made_from"]["config"]["aux_layers"]
    assert layers == list(features.store_layers(2))  # vLLM's default and the last layer's input
    assert {*default_aux_layer_ids(2), 1} == set(layers)
    assert store.arrays["aux"].shape[1] == len(layers) * store.arrays["hidden"].shape[1]
    assert main(["train", "features", "--model", "tiny", "--data", str(tmp_path / "none"), "--out", "g"]) == 2
    assert "no finished corpus" in capsys.readouterr().err


def test_a_store_of_a_share_of_the_corpus_holds_those_sequences_whole(corpus, tmp_path, capsys):
    """--sequences N: a seeded random N of the corpus's sequences (the ablations' shorter budget),
    each as its record reads, on the record's side of the split."""
    args = ["train", "features", "--model", "tiny", "--data", str(corpus), "--sequences", "5"]
    assert main([*args, "--out", str(tmp_path / "f")]) == 0
    store, records = FeatureStore(tmp_path / "f"), list(read_records(corpus))
    picked = np.load(tmp_path / "f" / "record.npy")
    assert len(store) == 5 < len(records) and len(set(picked.tolist())) == 5
    for s, r in enumerate(picked):
        record = records[int(r)]
        assert store.sequence(s)["tokens"].tolist() == record["prompt_ids"] + record["answer_ids"]
        assert bool(store.validation[s]) == (record["split"] == "validation")
    assert main([*args[:-1], "0", "--out", str(tmp_path / "g")]) == 2
    assert "--sequences must be at least 1" in capsys.readouterr().err


def test_eagle_trains_from_the_store_on_its_split(corpus, tmp_path, capsys):
    store = tmp_path / "f"
    assert main(["train", "features", "--model", "tiny", "--data", str(corpus), "--out", str(store)]) == 0
    args = ["train", "eagle", "--model", "tiny", "--data", str(store), "--out", str(tmp_path / "e"), "--vocab", "20"]
    assert main([*args, "--ttt-steps", "2", "--epochs", "1"]) == 0
    report = json.loads((tmp_path / "e" / "training.json").read_text())
    assert report["aux_layers"] == list(default_aux_layer_ids(2))  # read from the store, which holds more
    assert report["train_sequences"] == len(FeatureStore(store).indices(validation=False))


def test_the_draft_model_and_the_mask_adapter_train_from_the_store_on_its_split(corpus, tmp_path, capsys):
    """Every trainer reads a store in place: the draft model and the mask-token adapter train on its
    training side and validate on its validation side (the corpus's split by source)."""
    store = tmp_path / "f"
    assert main(["train", "features", "--model", "tiny", "--data", str(corpus), "--out", str(store)]) == 0
    sides = {side: len(FeatureStore(store).indices(validation=side)) for side in (False, True)}
    common = ["--model", "tiny", "--data", str(store)]
    assert main(["train", "draft", *common, "--out", str(tmp_path / "d"), "--vocab", "20", "--epochs", "1"]) == 0
    report = json.loads((tmp_path / "d" / "training.json").read_text())
    assert (report["train_sequences"], report["val_sequences"]) == (sides[False], sides[True])
    assert report["train_tokens"] == sum(
        len(features.store_sequence(FeatureStore(store), s).tokens) for s in FeatureStore(store).indices(False)
    )
    mtp = ["train", "mtp", *common, "--out", str(tmp_path / "m"), "--steps", "2", "--k-max", "3", "--rank", "4"]
    assert main(mtp) == 0
    report = json.loads((tmp_path / "m" / "training.json").read_text())
    assert report["train_sequences"] == sides[False] and 0 < report["val_sequences"] <= sides[True]
    assert main(["train", "data", *common]) == 2
    assert "is a feature store" in capsys.readouterr().err


def test_eagle_ablations_from_the_store(corpus, tmp_path, capsys):
    """--regression adds the hidden-state term (it needs a store's hidden states: refused on the old
    data set); --frozen-head-steps keeps the head at the target's rows while it lasts."""
    store = tmp_path / "f"
    assert main(["train", "features", "--model", "tiny", "--data", str(corpus), "--out", str(store)]) == 0
    out = tmp_path / "e"
    args = ["train", "eagle", "--model", "tiny", "--data", str(store), "--out", str(out), "--vocab", "20"]
    assert main([*args, "--ttt-steps", "2", "--epochs", "2", "--regression", "0.5", "--frozen-head-steps", "99"]) == 0
    report = json.loads((out / "training.json").read_text())
    assert report["config"]["regression_weight"] == 0.5 and report["history"][-1]["train_loss"] > 0
    target = load_model("tiny").model
    drafter = load_eagle3(out, embed=target.get_input_embeddings())
    rows = target.get_output_embeddings().weight[drafter.to_target_ids(torch.arange(drafter.config.draft_vocab_size))]
    torch.testing.assert_close(drafter.lm_head.weight.float(), rows.half().float())  # frozen all along
    data = tmp_path / "data"  # the older self-distillation set keeps no final hidden states for EAGLE-3
    flags = ["--instructions", "4", "--self-instruct", "0", "--contexts", "0", "--max-new-tokens", "4"]
    assert main(["train", "data", "--model", "tiny", "--data", str(data), *flags]) == 0
    capsys.readouterr()
    old = ["train", "eagle", "--model", "tiny", "--data", str(data), "--out", str(tmp_path / "o"), "--regression", "1"]
    assert main(old) == 2
    assert "the regression needs the target's final hidden states" in capsys.readouterr().err


def test_heads_read_the_store_in_place_as_they_read_copied_sequences(corpus, tmp_path, capsys):
    """store_positions (memory-mapped, one index for records and tokens) holds at every example what
    positions() builds from the same sequences copied out, for each side of the split; and `train
    heads` trains from a store."""
    model = load_model("tiny").model
    store = FeatureStore(build(model, corpus, tmp_path / "f", FeatureConfig(aux_layers=(0, 1), top_k=4)))
    index = torch.arange(model.config.vocab_size)
    index[::3] = -1  # a reduced vocabulary: labels outside it are −1 on both roads
    for side, mapped in zip((False, True), heads.store_positions(store, index, depth=3), strict=True):
        copied = heads.positions([features.store_sequence(store, s) for s in store.indices(side)], index, 3)
        assert len(mapped.record) == len(copied.record) > 0
        torch.testing.assert_close(mapped.reach, copied.reach)
        for j in range(1, 4):
            ok = copied.reach >= j
            for name in ("argmax", "topk_ids", "topk_p"):
                got = getattr(mapped, name)[(mapped.record + j)[ok]]
                torch.testing.assert_close(got, getattr(copied, name)[(copied.record + j)[ok]], msg=name)
            torch.testing.assert_close(mapped.tokens[(mapped.token + j)[ok]], copied.tokens[(copied.token + j)[ok]])
        torch.testing.assert_close(mapped.hidden[mapped.record], copied.hidden[copied.record])
    out = tmp_path / "h"
    assert main(["train", "heads", "--model", "tiny", "--data", str(tmp_path / "f"), "--out", str(out)]) == 0
    assert json.loads((out / "training.json").read_text())["train_positions"] == len(
        heads.store_positions(store, index, 3)[0].record
    )
    budget = ["--epochs", "3", "--steps", "2", "--out", str(tmp_path / "b")]  # --steps caps the epochs' 3 steps
    assert main(["train", "heads", "--model", "tiny", "--data", str(tmp_path / "f"), *budget]) == 0
    assert json.loads((tmp_path / "b" / "training.json").read_text())["history"][-1]["step"] == 2


def test_eagle_examples_read_the_layers_asked_of_a_store_that_holds_more(corpus, tmp_path):
    """A store of layers (0, 1, 2) serves a drafter of (2, 0): each example's features are those
    blocks, in that order, read only when collated; a layer the store lacks is refused by name; the
    validation side is cut to sequences spread over it when it exceeds `val_tokens`."""
    model = load_model("tiny", "cpu", "float32").model
    store = FeatureStore(build(model, corpus, tmp_path / "f", FeatureConfig(aux_layers=(0, 1, 2), top_k=4)))
    cfg, identity = EagleTrainConfig(), torch.arange(model.config.vocab_size)
    pending = store_examples(store, (2, 0), identity, cfg, validation=False)
    h = model.config.hidden_size
    for s, item in zip(store.indices(False), pending, strict=True):
        aux = store.sequence(s)["aux"]
        expected = torch.cat([aux[:, 2 * h : 3 * h], aux[:, :h]], -1)
        torch.testing.assert_close(collate([item])["features"][0, : len(item.tokens)], expected)
    short = replace(cfg, max_tokens=5)  # a sequence is trained on as its last 5 tokens, and batched so
    for s, item in zip(store.indices(False), store_examples(store, (2, 0), identity, short, False), strict=True):
        aux, tokens = store.sequence(s)["aux"], store.sequence(s)["tokens"]
        assert item.tokens.equal(tokens[-5:])
        expected = torch.cat([aux[-5:, 2 * h : 3 * h], aux[-5:, :h]], -1)
        torch.testing.assert_close(collate([item])["features"][0, : len(item.tokens)], expected)
    with pytest.raises(UserError, match=r"not \(3,\)"):
        store_examples(store, (0, 3), identity, cfg, validation=False)
    every = store.indices(True)
    sizes = [len(store.sequence(s)["tokens"]) for s in every]
    cut = store_examples(store, (0,), identity, replace(cfg, val_tokens=sum(sizes) // 2), validation=True)
    assert 0 < len(cut) < len(every) and cut[0].tokens.equal(store.sequence(every[0])["tokens"])


def experiment(name: str):
    """A script of experiments/ as a module (its `main` not run), and its path."""
    path = Path(__file__).resolve().parent.parent / "experiments" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return path, script


def test_the_ablation_script_trains_each_variant_once_and_tables_them(corpus, tmp_path, monkeypatch, capsys):
    """experiments/eagle_ablations.py from one store: each variant a run of its own, a finished run
    not run again (the script resumes), and a table row per variant from its last validation."""
    store, runs = tmp_path / "f", tmp_path / "runs"
    assert main(["train", "features", "--model", "tiny", "--data", str(corpus), "--out", str(store)]) == 0
    path, script = experiment("eagle_ablations")
    argv = [str(path), "--store", str(store), "--steps", "2", "--model", "tiny", "--runs", str(runs)]
    monkeypatch.setattr(sys, "argv", [*argv, "--only", "base", "norm_before_fc"])
    capsys.readouterr()
    script.main()
    first = capsys.readouterr().out
    assert first.count("== base: ") == 2 and first.count("== norm_before_fc: ") == 2  # its command, its time
    rows = [line for line in first.splitlines() if line.startswith("| base |") or line.startswith("| norm_before_fc |")]
    assert len(rows) == 2 and all(row.count("|") == len(script.COLUMNS) + 3 for row in rows)
    config = json.loads((runs / "norm_before_fc" / "training.json").read_text())["config"]
    assert config["norm_before_fc"] is True and config["loop"]["schedule"] == "wsd" and config["ttt_steps"] == 3
    script.main()  # both finished: nothing trained again, the same table
    again = capsys.readouterr().out
    assert "== " not in again and [r for r in again.splitlines() if r.startswith("| base |")] == rows[:1]


def test_the_retraining_script_trains_each_drafter_from_the_store_and_tables_before_and_after(
    corpus, tmp_path, monkeypatch, capsys
):
    """experiments/retrain_drafters.py: heads, draft and mask adapter each trained from one store
    (afresh here: the shipped weights are the embedded model's), a finished run not run again, and
    their held-out scores before and after in one table; from shipped weights, each run carries
    their own settings."""
    store, runs = tmp_path / "f", tmp_path / "runs"
    assert main(["train", "features", "--model", "tiny", "--data", str(corpus), "--out", str(store)]) == 0
    path, script = experiment("retrain_drafters")
    argv = [str(path), "--store", str(store), "--model", "tiny", "--runs", str(runs), "--fresh", "--mtp-steps", "2"]
    argv += ["--heads-steps", "1", "--draft-steps", "1"]  # a budget each (the draft's 2 epochs are 2 steps here)
    monkeypatch.setattr(sys, "argv", argv)
    capsys.readouterr()
    script.main()
    out = capsys.readouterr().out
    assert all(out.count(f"== {kind}: ") == 2 for kind in ("heads", "draft", "mtp"))
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| drafter")]
    decided = {line.split(" | ")[0][2:] for line in rows if line.endswith("| after |") or line.endswith("| before |")}
    assert decided == {"heads", "draft", "mtp"}  # each drafter's deciding figure, held out
    assert any(line.startswith("| heads | top1_depth1 |") for line in rows)
    for kind, steps in (("heads", 1), ("draft", 1), ("mtp", 2)):
        report = json.loads((runs / kind / "training.json").read_text())
        assert report["config"]["loop"]["max_steps"] == steps and report["history"][-1]["step"] == steps, kind
    script.main()  # all finished: nothing trained again
    assert "== " not in capsys.readouterr().out
    shipped = script.KINDS["mtp"][0]
    cmd = script.command("mtp", store, tmp_path / "m", shipped, None, 5)
    config = json.loads((shipped / "training.json").read_text())["config"]
    assert cmd[cmd.index("--k-max") + 1] == str(config["k_max"]) and cmd[cmd.index("--gating") + 1] == config["gating"]
    assert cmd[cmd.index("--start-from") + 1] == str(shipped) and cmd[cmd.index("--steps") + 1] == "5"
