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
from mtp_viz.loading import load_model
from mtp_viz.training.loop import LoopConfig, train


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
    assert report["history"] and "val_agreement" in report["history"][-1]

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


def test_resume_continues_the_same_run(tmp_path):
    """A run stopped after a checkpoint and resumed ends with the weights of an uninterrupted one."""
    cfg = LoopConfig(epochs=2, lr=0.05, warmup_steps=2, eval_every=3, checkpoint_every=1)
    batches = [torch.randn(8, 3, generator=torch.Generator().manual_seed(i)) for i in range(5)]

    def run(out, stop_at=None, resume=False):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.zeros(3))
        calls = []

        def loss(x):
            calls.append(1)
            if stop_at is not None and len(calls) > stop_at:
                raise KeyboardInterrupt
            return ((x @ w - 1.0) ** 2).mean() + 0.01 * torch.randn(()), {}

        train(
            {"w": w},
            lambda epoch: batches[epoch:] + batches[:epoch],
            loss,
            lambda: {"w0": w[0].item()},
            out,
            cfg,
            resume,
            log=lambda m: None,
        )
        return w.detach().clone()

    straight = run(tmp_path / "a")
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "b", stop_at=4)
    resumed = run(tmp_path / "b", resume=True)
    torch.testing.assert_close(resumed, straight)
