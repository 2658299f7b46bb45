"""Training code end to end on a tiny random model (seconds), and the loop's resume."""

import json

import pytest
import torch
from conftest import decode, save_tiny_dir
from safetensors.torch import load_file

from mtp_viz.__main__ import main
from mtp_viz.drafters.draft import load_draft
from mtp_viz.drafters.heads import load_heads
from mtp_viz.drafters.vocab import ReducedHead, frequent_tokens
from mtp_viz.errors import UserError
from mtp_viz.loading import load_model
from mtp_viz.training.loop import STABLE, LoopConfig, lr_at, train


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_dir(tmp_path_factory.mktemp("tiny-train") / "target", model_name="llama-3l-mha")


def test_train_data_draft_and_heads_end_to_end(tiny_dir, tmp_path, capsys):
    data, draft_dir, heads_dir = tmp_path / "data", tmp_path / "draft", tmp_path / "heads"
    common = ["--model", str(tiny_dir), "--data", str(data)]
    data_flags = ["--instructions", "12", "--self-instruct", "4", "--contexts", "2"]
    data_flags += ["--max-new-tokens", "6", "--batch-size", "5"]
    assert main(["train", "data", *common, *data_flags]) == 0
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["rounds"]["instructions"] == 3  # 12 prompts in batches of 5
    written = json.loads((data / "self_instruct-prompts.json").read_text())
    assert len(written) == len(set(written)) == 4 and manifest["rounds"]["self_instruct"] == 1
    shard_times = {p: p.stat().st_mtime_ns for p in data.glob("*.pt")}
    assert main(["train", "data", *common]) == 0  # complete: nothing is generated again
    assert {p: p.stat().st_mtime_ns for p in data.glob("*.pt")} == shard_times

    assert (
        main(["train", "draft", *common, "--out", str(draft_dir), "--layers", "2", "--vocab", "20", "--epochs", "2"])
        == 0
    )
    assert (
        main(["train", "heads", *common, "--out", str(heads_dir), "--depth", "2", "--vocab", "20", "--epochs", "2"])
        == 0
    )
    out = capsys.readouterr().out
    assert "draft trained" in out and "heads trained" in out

    target = load_model(str(tiny_dir))
    draft = load_draft(target.model, draft_dir)
    assert len(draft.model.layers) == 2 and draft.lm_head.weight.shape == (20, target.model.config.hidden_size)
    assert draft.model.embed_tokens is target.model.model.embed_tokens  # shared, not shipped
    report = json.loads((draft_dir / "training.json").read_text())
    assert report["history"] and {"val_agreement", "heldout_agreement"} <= set(report["history"][-1])
    assert {"heldout_top1_depth1", "heldout_top1_depth2"} <= set(
        json.loads((heads_dir / "training.json").read_text())["before"]
    )

    # The trained draft drives speculative decoding, which stays lossless.
    prompt = [4, 5, 6, 7, 4, 5]
    ar, _ = decode(target.model, "autoregressive", prompt)
    spec, steps = decode(target.model, "speculative", prompt, draft=draft, num_draft_tokens=3)
    assert spec == ar
    assert all(d.token_id in set(draft.lm_head.ids.tolist()) for s in steps for d in s.drafted)

    heads = load_heads(target.model, heads_dir)
    hidden = torch.randn(3, target.model.config.hidden_size)
    nxt = heads.step(hidden, torch.tensor([1, 2, 3]))
    assert nxt.shape == hidden.shape and heads.logits(nxt).shape == (3, target.model.config.vocab_size)

    # --start-from continues from the saved weights: with a negligible learning rate it saves them
    # again (a run without it would start from the target's layers / fresh heads instead)
    for what, src, extra in (("draft", draft_dir, []), ("heads", heads_dir, ["--depth", "2"])):
        again = tmp_path / f"{what}-again"
        flags = ["--out", str(again), "--start-from", str(src), "--epochs", "1", "--lr", "1e-12", *extra]
        assert main(["train", what, *common, *flags]) == 0
        assert json.loads((again / "training.json").read_text())["started_from"] == str(src)
        before, after = load_file(src / "weights.safetensors"), load_file(again / "weights.safetensors")
        assert before.keys() == after.keys()
        for name in before:
            torch.testing.assert_close(after[name].float(), before[name].float(), atol=1e-3, rtol=0)


def test_reduced_head_scores_only_its_subset():
    weight = torch.randn(10, 4)
    ids = frequent_tokens([torch.tensor([3, 3, 3, 7, 7, 1, 9])], size=3, always=[0])
    assert ids.tolist() == [0, 3, 7]  # EOS-like id kept, then by frequency
    head = ReducedHead(weight, ids, vocab_size=10)
    h = torch.randn(2, 4)
    full = head(h)
    assert torch.isinf(full[:, [1, 2, 4, 5, 6, 8, 9]]).all()
    torch.testing.assert_close(full[:, ids], h @ weight[ids].T)
    assert head.index[7] == 2 and head.index[5] == -1


BATCHES = [torch.randn(8, 3, generator=torch.Generator().manual_seed(i)) for i in range(5)]


def fit(out, cfg, stop_at=None, resume=False):
    """A tiny regression trained by the loop (noisy loss: the RNG state must carry over); its weights."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.zeros(3))
    calls = []

    def loss(x):
        calls.append(1)
        if stop_at is not None and len(calls) > stop_at:
            raise KeyboardInterrupt
        return ((x @ w - 1.0) ** 2).mean() + 0.01 * torch.randn(()), {}

    epoch_batches = lambda epoch: BATCHES[epoch % 5 :] + BATCHES[: epoch % 5]  # noqa: E731
    train({"w": w}, epoch_batches, loss, lambda: {"w0": w[0].item()}, out, cfg, resume, log=lambda m: None)
    return w.detach().clone()


def test_resume_continues_the_same_run(tmp_path):
    """A run stopped after a checkpoint and resumed ends with the weights of an uninterrupted one."""
    cfg = LoopConfig(epochs=2, lr=0.05, warmup_steps=2, eval_every=3, checkpoint_every=1)
    straight = fit(tmp_path / "a", cfg)
    with pytest.raises(KeyboardInterrupt):
        fit(tmp_path / "b", cfg, stop_at=4)
    resumed = fit(tmp_path / "b", cfg, resume=True)
    torch.testing.assert_close(resumed, straight)


def test_schedules():
    """cosine ends at zero; constant keeps the rate after warm-up; wsd keeps it, then decays linearly
    over its last share."""
    cos, const = LoopConfig(lr=1.0, warmup_steps=2), LoopConfig(lr=1.0, warmup_steps=2, schedule="constant")
    wsd = LoopConfig(lr=1.0, warmup_steps=2, schedule="wsd", decay_share=0.25)
    assert [lr_at(s, 20, cos) for s in (0, 1)] == [0.5, 1.0] == [lr_at(s, 20, wsd) for s in (0, 1)]
    assert lr_at(19, 20, cos) < 0.01 and lr_at(10, 20, cos) < 0.6
    assert {lr_at(s, 20, const) for s in range(2, 20)} == {1.0}
    assert wsd.decay_start(20) == 15
    assert {lr_at(s, 20, wsd) for s in range(2, 15)} == {1.0}
    assert [round(lr_at(s, 20, wsd), 6) for s in range(15, 20)] == [1.0, 0.8, 0.6, 0.4, 0.2]
    with pytest.raises(ValueError, match="schedule"):
        LoopConfig(schedule="linear")


@pytest.mark.parametrize("schedule", ["constant", "wsd"])
def test_a_finished_run_made_longer_ends_as_the_longer_run(tmp_path, schedule):
    """--resume with more steps: a constant run goes on from its last checkpoint; a wsd run from the
    state kept where its decay began (checkpoint-stable.pt), to decay at the new end. Either ends with
    the weights of a run that was that long from the start."""
    short = LoopConfig(epochs=4, lr=0.05, warmup_steps=2, eval_every=4, schedule=schedule, max_steps=10)
    long = LoopConfig(**{**short.__dict__, "max_steps": 18})
    straight = fit(tmp_path / "a", long)
    fit(tmp_path / "b", short)
    assert (tmp_path / "b" / STABLE).exists() == (schedule == "wsd")
    longer = fit(tmp_path / "b", long, resume=True)
    torch.testing.assert_close(longer, straight)
    assert not torch.allclose(fit(tmp_path / "c", short), straight)  # the extension trained something


def test_a_cosine_run_is_not_made_longer(tmp_path):
    short = LoopConfig(epochs=4, lr=0.05, warmup_steps=2, max_steps=6)
    fit(tmp_path / "a", short)
    with pytest.raises(UserError, match="cosine"):
        fit(tmp_path / "a", LoopConfig(**{**short.__dict__, "max_steps": 12}), resume=True)
    with pytest.raises(UserError, match="other settings"):
        fit(tmp_path / "a", LoopConfig(**{**short.__dict__, "lr": 0.1}), resume=True)
