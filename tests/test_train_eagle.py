"""EAGLE-3 training on a tiny random target: training-time test computes what drafting computes,
and `train eagle` runs end to end, resumably, into a checkpoint the loader reads."""

import json
import random
from dataclasses import replace

import pytest
import torch
from conftest import save_tiny_dir, tiny_model

from mtp_viz.__main__ import main
from mtp_viz.drafters.eagle3 import load_eagle3, save_eagle3
from mtp_viz.loading import load_model
from mtp_viz.runner import RunRequest, run
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.training import eagle_examples
from mtp_viz.training.data import Sequence
from mtp_viz.training.draft import batches_of
from mtp_viz.training.eagle import (
    EagleTrainConfig,
    Example,
    add_input_norm,
    agreement,
    build_drafter,
    collate,
    losses,
    vocab_tokens,
)
from mtp_viz.training.eagle_unroll import chain_bases, step_labels, unroll


def _drafter(seed: int = 0, kv_heads: int = 4):
    """kv_heads < 4: grouped queries (the embedded target's 9 heads share 3)."""
    target = tiny_model("llama-3l-mha", vocab_size=64, num_key_value_heads=kv_heads)
    vocab = torch.tensor([0, 3, 5, 8, 9, 12, 20, 33, 40, 41, 50, 63])
    drafter = build_drafter(target, (0, 1, 2), vocab)
    torch.manual_seed(seed)
    with torch.no_grad():  # a random, untrained drafter whose every weight matters
        for p in drafter.parameters():
            if p is not target.get_input_embeddings().weight:
                p.add_(torch.randn_like(p) * 0.3)
    return target, drafter.eval()


def _example(tokens: torch.Tensor, features: torch.Tensor) -> Example:
    n = len(tokens)
    return Example(
        tokens=tokens,
        features=features.half(),
        argmax=torch.zeros(n, dtype=torch.long),
        topk_ids=torch.zeros(n, 2, dtype=torch.long),
        topk_p=torch.full((n, 2), 0.5),
        weight=torch.ones(n),
    )


@torch.no_grad()
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_training_time_test_computes_what_drafting_computes(kv_heads):
    """Step j of chain i in training equals drafting after position i: the drafter's cache holds
    step-1 entries for positions 0..i (from the target's features), then its own chain."""
    target, drafter = _drafter(kv_heads=kv_heads)
    g = torch.Generator().manual_seed(1)
    n, steps = 11, 3
    tokens = torch.randint(0, 64, (n,), generator=g)
    features = torch.randn(n, drafter.config.fc_input_size, generator=g)
    short = _example(tokens[:7], features[:7])  # a shorter sequence in the batch: padding must not leak
    batch = collate([_example(tokens, features), short])
    trained = dict(unroll(drafter, batch, steps))  # step → (B, T, V_d)
    fused = drafter.fuse(batch["features"][0].float())  # the half-precision features training reads
    for i in (0, 4, 7):
        cache = drafter.new_cache(64)
        logits, out = drafter(fused[: i + 1], tokens[1 : i + 2], torch.arange(i + 1), cache)
        hidden, last = out[-1:], logits[-1]
        for j in range(1, steps + 1):
            if j > 1:
                logits, hidden = drafter(hidden, tokens[i + j : i + j + 1], torch.tensor([i + j - 1]), cache)
                last = logits[0]
            assert torch.allclose(trained[j][0, i], last, atol=1e-4), (i, j)
    short_alone = dict(unroll(drafter, collate([short]), steps))
    for j in range(1, steps + 1):
        assert torch.allclose(trained[j][1, :6], short_alone[j][0], atol=1e-4)


@torch.no_grad()
def test_chains_from_where_labels_count_are_the_chains_every_base_computes():
    """With prompt positions unweighted, a loss unrolls only the chains from each row's first
    counted label on, left-aligned (T' < T): each is what unrolling every base gives that chain,
    with the same labels; the padding of the shorter row is not counted."""
    _, drafter = _drafter()
    g = torch.Generator().manual_seed(3)
    rows = []
    for n, prompt in ((12, 6), (8, 2)):
        ex = _example(torch.randint(0, 64, (n,), generator=g), torch.randn(n, drafter.config.fc_input_size))
        ex.argmax[:] = torch.randint(0, 12, (n,), generator=g)
        ex.weight[:prompt], ex.weight[-1] = 0.0, 0.0  # a prompt; the last position has no label
        rows.append(ex)
    batch = collate(rows)
    bases, real = chain_bases(batch)
    assert bases[0, 0] == 5 and bases[1, 0] == 1  # base i's first label is position i + 1's
    assert real.sum(1).tolist() == [5, 5] and bases.shape[1] == 5 < batch["tokens"].shape[1] - 1
    steps = 3
    every = dict(unroll(drafter, batch, steps))
    chosen = dict(unroll(drafter, batch, steps, bases=bases))
    t = batch["tokens"].shape[1] - 1
    all_bases = torch.arange(t).expand(2, t)
    for j in range(1, steps + 1):
        labels, full = step_labels(batch, j, bases, real), step_labels(batch, j, all_bases)
        for b in range(2):
            for r in range(bases.shape[1]):
                i = int(bases[b, r])
                if not real[b, r]:
                    assert labels[3][b, r] == 0
                    continue
                torch.testing.assert_close(chosen[j][b, r], every[j][b, i], atol=1e-4, rtol=1e-4)
                assert all(torch.equal(x[b, r], y[b, i]) for x, y in zip(labels, full, strict=True))


@torch.no_grad()
@pytest.mark.parametrize("prompt_weight", [0.0, 0.2])
def test_agreement_unrolls_only_chains_that_reach_an_answer_and_scores_as_every_chain_would(prompt_weight):
    """Validation unrolls the chains from `steps` − 1 bases before each row's answer on: per-step
    top-1 and tokens per forward equal those counted over every chain, with prompts of several
    lengths (a chain based in a prompt reaches answer labels at its later steps), prompts weighted
    or not (a weighted prompt is still not scored), in one batch or several."""
    _, drafter = _drafter(kv_heads=2)
    g = torch.Generator().manual_seed(5)
    exs = []
    for n, prompt in ((14, 7), (9, 2), (12, 10), (6, 5)):
        ex = _example(torch.randint(0, 64, (n,), generator=g), torch.randn(n, drafter.config.fc_input_size))
        ex.argmax[:] = torch.randint(0, 12, (n,), generator=g)
        ex.weight[:prompt], ex.weight[-1] = prompt_weight, 0.0
        exs.append(ex)
    steps = 3
    right, counted, alive_sum, complete = [0.0] * steps, [0.0] * steps, [0.0] * steps, 0.0
    for ex in exs:  # every chain of each row alone, counted on answer labels
        batch = collate([ex])
        every = torch.arange(batch["tokens"].shape[1] - 1)[None]
        reach = alive = None
        alives = []
        for j, logits in unroll(drafter, batch, steps):
            argmax, _, _, weight = step_labels(batch, j, every)
            answer, ok = weight == 1.0, logits.argmax(-1) == argmax
            right[j - 1] += float((ok & answer).sum())
            counted[j - 1] += float(answer.sum())
            reach = answer if reach is None else reach & answer
            alive = ok if alive is None else alive & ok
            alives.append(alive)
        alive_sum = [a + float((x & reach).sum()) for a, x in zip(alive_sum, alives, strict=True)]
        complete += float(reach.sum())
    expected = {f"val_top1_step{j + 1}": right[j] / counted[j] for j in range(steps)}
    expected["val_mean_accepted_tokens"] = 1 + sum(alive_sum) / complete
    assert 0 < expected["val_top1_step1"] < 1 and expected["val_mean_accepted_tokens"] > 1  # not trivially equal
    for budget in (10**6, 12):  # one batch, or several
        assert agreement(drafter, exs, steps, budget=budget) == pytest.approx(expected, abs=1e-6)
    batch = collate(exs)
    bases, real = chain_bases(batch, lookback=steps - 1, answer_only=True)
    assert bases.shape[1] <= 8 + steps - 1 < batch["tokens"].shape[1] - 1  # the longest answer's chains, not every base


def test_an_examples_answer_span_is_the_same_on_every_road():
    """`answer` (what EAGLE-3 batches are sized and ordered by) of a store's or a corpus's sequence
    before it is made an example equals the example's own, for every cut of the window."""
    cfg = EagleTrainConfig()
    index = torch.arange(64)
    for n in range(2, 14):
        for prompt_len in range(1, n):
            for window in (1, 2, 3, 5, 8, 20):
                tokens = torch.arange(n, dtype=torch.int32)
                labels = torch.zeros(n - 1, dtype=torch.int32)
                seq = Sequence(
                    tokens, prompt_len, None, labels, torch.zeros(n - 1, 2, dtype=torch.int32), torch.zeros(n - 1, 2)
                )
                ex = eagle_examples.example(seq, torch.zeros(n, 3), index, replace(cfg, max_tokens=window))
                assert ex.answer == eagle_examples.in_window(n, prompt_len, window), (n, prompt_len, window)


def test_chain_batches_group_answers_of_a_length_within_both_budgets():
    """With prompts unweighted, EAGLE-3 batches rows of like answer length together (the chains a
    loss unrolls): rows × the longest answer within the budget, rows × the longest window within
    WINDOW_ROOM times it, every example once, and less chain padding than batching by length."""
    g = torch.Generator().manual_seed(4)
    exs = []
    for n, prompt in [(40, 35), (40, 5), (30, 25), (30, 2), (20, 16), (20, 1), (12, 8), (12, 2)] * 2:
        ex = _example(torch.randint(0, 64, (n,), generator=g), torch.zeros(n, 3))
        ex.weight[: prompt - 1], ex.weight[-1] = 0.0, 0.0
        exs.append(ex)
    assert [e.answer for e in exs[:2]] == [6, 36]  # positions from the prompt's last on
    budget = 40
    by_answer = eagle_examples.chain_batches(exs, budget, random.Random(0))
    by_length = batches_of(exs, eagle_examples.WINDOW_ROOM * budget, random.Random(0))
    for groups in (by_answer, by_length):
        assert sorted(id(e) for g in groups for e in g) == sorted(id(e) for e in exs)
        assert all(len(g) * max(len(e.tokens) for e in g) <= eagle_examples.WINDOW_ROOM * budget for g in groups)
    assert all(len(g) * max(e.answer for e in g) <= budget for g in by_answer)
    width = lambda groups: sum(len(g) * max(e.answer for e in g) for g in groups)  # noqa: E731
    assert width(by_answer) < width(by_length)


def test_losses_fall_on_a_batch_it_trains_on():
    _, drafter = _drafter()
    drafter.train()
    g = torch.Generator().manual_seed(2)
    ex = _example(torch.randint(0, 64, (12,), generator=g), torch.randn(12, drafter.config.fc_input_size))
    ex.argmax[:] = torch.randint(0, 12, (12,), generator=g)
    batch = collate([ex])
    cfg = EagleTrainConfig(ttt_steps=2)
    params = [p for n, p in drafter.named_parameters() if not n.startswith("embed_tokens")]
    opt = torch.optim.Adam(params, lr=1e-2)
    first, stats = losses(drafter, batch, cfg)
    assert set(stats) == {"loss1", "loss2"}
    for _ in range(20):
        loss, _ = losses(drafter, batch, cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.5 * float(first.detach())


@torch.no_grad()
def test_an_input_norm_added_to_a_trained_drafter_keeps_its_fused_input_at_the_median_scale(tmp_path):
    """norm_before_fc given to a drafter trained without it: at a position of the median scale the
    fused input is what it was; elsewhere it is that input rescaled to the median (the norm's
    point); padding (zeros) does not count; the flag and the weight survive a save and a load."""
    target, drafter = _drafter()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, drafter.config.fc_input_size, generator=g) * torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])[:, None]
    rms = x.pow(2).mean(-1).sqrt()
    before = drafter.fuse(x)
    add_input_norm(drafter, torch.cat([x, torch.zeros(3, x.shape[1])])[None])  # (1, 8, F): 3 padded rows
    assert drafter.config.norm_before_fc and float(drafter.input_norm.weight[0]) == pytest.approx(float(rms.median()))
    after = drafter.fuse(x)
    mid = int(rms.argsort()[2])
    torch.testing.assert_close(after[mid], before[mid], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(after, before * (rms.median() / rms)[:, None], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(after[0], before[0], rtol=1e-2)
    save_eagle3(drafter, tmp_path / "d")
    loaded = load_eagle3(tmp_path / "d", embed=target.get_input_embeddings())
    assert loaded.config.norm_before_fc
    torch.testing.assert_close(loaded.fuse(x), after)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_dir(tmp_path_factory.mktemp("tiny-eagle") / "target", model_name="llama-3l-mha")


def test_train_eagle_end_to_end_and_resume(tiny_dir, tmp_path, capsys):
    data, out = tmp_path / "data", tmp_path / "eagle"
    common = ["--model", str(tiny_dir), "--data", str(data)]
    data_flags = ["--instructions", "10", "--self-instruct", "0", "--contexts", "0", "--max-new-tokens", "6"]
    assert main(["train", "data", *common, *data_flags]) == 0
    args = ["train", "eagle", *common, "--out", str(out), "--ttt-steps", "2", "--vocab", "20", "--epochs", "2"]
    assert main([*args, "--aux-layers", "0,1,2"]) == 0
    assert "eagle trained" in capsys.readouterr().out
    report = json.loads((out / "training.json").read_text())
    assert report["aux_layers"] == [0, 1, 2]
    assert {"val_top1_step1", "val_top1_step2", "val_mean_accepted_tokens"} <= set(report["history"][-1])
    config = json.loads((out / "config.json").read_text())
    assert 0 < config["draft_vocab_size"] <= 20  # the tokens the tiny data holds, at most --vocab
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert config["trained_draft_steps"] == 2  # the steps unrolled: the deepest chain it drafts
    assert report["history"][-1]["train_loss"] > 0 and report["history"][-1]["lr"] >= 0
    assert {"heldout_top1_step1", "heldout_top1_step2", "heldout_mean_accepted_tokens"} <= set(report["history"][-1])
    curves = (out / "curves.md").read_text()  # loss, validation, held-out and chain charts, then the table
    assert curves.count("xychart-beta") == 4 and "| step | val_top1_step1 |" in curves
    losses = ", ".join(f"{h['train_loss']:.4g}" for h in report["history"])
    assert f"line [{losses}]" in curves.split("```mermaid")[1]  # the loss chart: the entries that have one

    target = load_model(str(tiny_dir))
    drafter = load_eagle3(out, embed=target.model.get_input_embeddings())
    assert drafter.config.aux_layer_ids == (0, 1, 2) and drafter.embed_tokens is target.model.get_input_embeddings()
    assert target.model.get_input_embeddings().weight.dtype == torch.float32  # the shared embedding was not cast
    features = next((data / "features" / "0-1-2").glob("*.pt"))
    cached = torch.load(features)
    assert cached[0].shape[1] == 3 * target.model.config.hidden_size

    # a deeper chain than it was trained for is capped at its 2 steps (the trace says so)
    request = RunRequest(prompt="hello", model=str(tiny_dir), strategy="eagle", eagle3=str(out))
    request = replace(request, strategy_settings={"depth": 4}, generation=GenerationSettings(max_new_tokens=6))
    trace = run(request)
    assert trace.settings["depth"] == 2
    assert max(len(step.drafted) for step in trace.steps) == 2

    # the same run resumed from its last checkpoint ends where it ended
    weights = (out / "model.safetensors").read_bytes()
    assert main([*args, "--aux-layers", "0,1,2", "--resume"]) == 0
    assert (out / "model.safetensors").read_bytes() == weights


def test_ablation_settings_reach_the_drafter(tiny_dir, tmp_path, capsys):
    """A fresh drafter has the feature norm (saved in its config) and counts its vocabulary over answer
    tokens and the target's answer-position argmaxes only (the ablations' winners, the defaults);
    --no-norm-before-fc and --vocab-from all build one without; the report says how much of the
    held-out answers' target tokens the vocabulary holds."""
    data, out = tmp_path / "data", tmp_path / "eagle"
    common = ["--model", str(tiny_dir), "--data", str(data)]
    assert main(["train", "data", *common, "--instructions", "8", "--self-instruct", "0", "--contexts", "0"]) == 0
    args = ["train", "eagle", *common, "--out", str(out), "--ttt-steps", "2", "--epochs", "1", "--heldout", "1"]
    assert main([*args, "--aux-layers", "0,1,2"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_config"]["norm_before_fc"] is True
    report = json.loads((out / "training.json").read_text())
    assert report["config"]["vocab_from"] == "answers" and 0.0 <= report["heldout_vocab_coverage"] <= 1.0
    # from a drafter trained without it, the flag gives it the norm (scaled to its features) and trains on
    plain, normed = tmp_path / "plain", tmp_path / "normed"
    plain_flags = ["--ttt-steps", "2", "--epochs", "1", "--no-norm-before-fc", "--vocab-from", "all"]
    assert main(["train", "eagle", *common, "--out", str(plain), *plain_flags]) == 0
    assert json.loads((plain / "config.json").read_text())["eagle_config"]["norm_before_fc"] is False
    assert json.loads((plain / "training.json").read_text())["config"]["vocab_from"] == "all"
    keeps = tmp_path / "keeps"  # from a drafter without it, and no flag: it stays without
    assert main(["train", "eagle", *common, "--out", str(keeps), "--ttt-steps", "2", "--start-from", str(plain)]) == 0
    assert json.loads((keeps / "config.json").read_text())["eagle_config"]["norm_before_fc"] is False
    again = ["train", "eagle", *common, "--out", str(normed), "--ttt-steps", "2", "--epochs", "1"]
    assert main([*again, "--start-from", str(plain), "--norm-before-fc"]) == 0
    assert json.loads((normed / "config.json").read_text())["eagle_config"]["norm_before_fc"] is True
    target = load_model(str(tiny_dir))
    drafter = load_eagle3(normed, embed=target.model.get_input_embeddings())
    assert drafter.config.norm_before_fc and drafter.input_norm.weight.shape == (drafter.config.fc_input_size,)
    captured = capsys.readouterr()
    assert "an input norm added before fc" in captured.out + captured.err
    s = Sequence(torch.tensor([5, 6, 7, 8], dtype=torch.int32), 2, None, torch.tensor([9, 10, 11]), None, None)
    assert vocab_tokens(s, "answers").tolist() == [7, 8, 10, 11] and len(vocab_tokens(s, "all")) == 7


def test_train_eagle_rejects_bad_layer_ids(tiny_dir, tmp_path, capsys):
    code = main(["train", "eagle", "--model", str(tiny_dir), "--out", str(tmp_path / "o"), "--aux-layers", "2;15"])
    assert code != 0
    assert "--aux-layers takes layer ids separated by commas" in capsys.readouterr().err
