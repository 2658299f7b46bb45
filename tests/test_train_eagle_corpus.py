"""EAGLE-3 trained straight from a corpus (the target's view computed batch by batch, no feature
store), and a run continued on another machine: where the run's checkpoint folder is gone, --resume
restarts from the weights and report it saved in --out at its last checkpoint, on the same batches
from the same step, with a fresh optimizer warmed up again."""

import gzip
import json
import shutil
from dataclasses import asdict, replace

import pytest
import torch

from mtp_viz.cli import main
from mtp_viz.drafters.eagle3 import load_eagle3
from mtp_viz.errors import UserError
from mtp_viz.loading import load_model
from mtp_viz.paths import cache_root
from mtp_viz.training import eagle, loop
from mtp_viz.training.corpus import VALIDATION, read_records
from mtp_viz.training.loop import CHECKPOINT, LoopConfig, TrainJob


@pytest.fixture
def corpus(tiny_corpus):
    return tiny_corpus


def test_eagle_trains_straight_from_a_corpus_on_its_split(corpus, tmp_path, capsys):
    out = tmp_path / "e"
    args = ["train", "eagle", "--model", "tiny", "--data", str(corpus), "--out", str(out), "--vocab", "20"]
    assert main([*args, "--ttt-steps", "2", "--epochs", "1"]) == 0
    report = json.loads((out / "training.json").read_text())
    records = list(read_records(corpus))
    assert report["train_sequences"] == sum(r["split"] != VALIDATION for r in records)
    assert report["history"][-1]["train_loss"] > 0 and "val_top1_step2" in report["history"][-1]
    assert report["step"] == report["history"][-1]["step"]
    assert not (corpus / "runs").exists()  # checkpoints go to the cache, never into a corpus
    (runs,) = (cache_root() / "runs" / "tiny").glob("e-*")  # one folder per --out path
    assert (runs / CHECKPOINT).is_file()
    # the other trainers read a corpus through its feature store
    capsys.readouterr()
    heads = ["train", "heads", "--model", "tiny", "--data", str(corpus), "--out", str(tmp_path / "h")]
    assert main(heads) == 2
    assert "train features makes it" in capsys.readouterr().err


def test_an_unfinished_corpus_is_refused(corpus, tmp_path, capsys):
    manifest = json.loads((corpus / "manifest.json").read_text())
    (corpus / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    args = ["train", "eagle", "--model", "tiny", "--data", str(corpus), "--out", str(tmp_path / "e")]
    assert main(args) == 2
    assert "not finished" in capsys.readouterr().err


def _run(corpus, out, runs, steps: int, resume: bool, seen: list | None = None, **changes):
    loop = LoopConfig(epochs=50, lr=1e-3, warmup_steps=4, eval_every=2, checkpoint_every=2, max_steps=steps)
    loop = replace(loop, schedule="constant")
    settings = {"ttt_steps": 2, "reduced_vocab": 20, "heldout_per_category": 0, **changes}
    cfg = eagle.EagleTrainConfig(**settings, loop=loop)
    job = TrainJob(load_model("tiny"), corpus, out, runs, resume=resume, log=lambda _: None)
    if seen is None:
        return eagle.train_eagle(job, cfg)
    losses = eagle.losses

    def recording(drafter, batch, c):  # which batch each step trains on
        seen.append(int(batch["tokens"].sum()))
        return losses(drafter, batch, c)

    eagle.losses = recording
    try:
        return eagle.train_eagle(job, cfg)
    finally:
        eagle.losses = losses


def test_a_run_goes_on_on_another_machine_from_what_it_saved(corpus, tmp_path):
    straight, first, more, last = [], [], [], []
    _run(corpus, tmp_path / "straight", tmp_path / "runs-s", 8, False, straight)
    _run(corpus, tmp_path / "e", tmp_path / "runs", 4, False, first)
    saved = json.loads((tmp_path / "e" / "training.json").read_text())
    assert saved["step"] == 4 and [h["step"] for h in saved["history"]] == [2, 4]
    weights = (tmp_path / "e" / "model.safetensors").read_bytes()
    shutil.copytree(tmp_path / "runs", tmp_path / "runs-b")  # machine B's checkpoint at step 4
    shutil.rmtree(tmp_path / "runs")  # machine A: only what --out holds is left
    report = _run(corpus, tmp_path / "e", tmp_path / "runs", 6, True, more)
    assert first + more == straight[:6]  # the same batches, from the step it had reached
    assert report["step"] == 6 and [h["step"] for h in report["history"]] == [2, 4, 6]
    assert report["history"][:2] == saved["history"] and report["before"] == saved["before"]
    assert report["seconds"] > saved["seconds"]  # counted across both machines
    assert report["history"][-1]["lr"] == pytest.approx(1e-3 * 2 / 4)  # warmed up again: its 2nd step of 4
    assert (tmp_path / "e" / "model.safetensors").read_bytes() != weights
    target = load_model("tiny").model
    drafter = load_eagle3(tmp_path / "e", embed=target.get_input_embeddings())
    assert drafter.config.draft_vocab_size <= 20 and drafter.embed_tokens is target.get_input_embeddings()
    assert json.loads((tmp_path / "e" / "config.json").read_text())["torch_dtype"] == "float16"
    assert target.get_input_embeddings().weight.dtype == torch.float32  # saved in float16, nothing cast
    assert not (tmp_path / "e" / ".saving").exists()

    # restarted with nothing left to train, the weights it loaded are the ones it saved
    weights = (tmp_path / "e" / "model.safetensors").read_bytes()
    shutil.rmtree(tmp_path / "runs")
    _run(corpus, tmp_path / "e", tmp_path / "runs", 6, True)
    assert (tmp_path / "e" / "model.safetensors").read_bytes() == weights

    # back on machine B, whose checkpoint (step 4) the run has gone past: it goes on from step 6
    shutil.rmtree(tmp_path / "runs")
    report = _run(corpus, tmp_path / "e", tmp_path / "runs-b", 8, True, last)
    assert last == straight[6:] and [h["step"] for h in report["history"]] == [2, 4, 6, 8]

    shutil.rmtree(tmp_path / "runs-b")  # a restart with other settings is refused, not mixed in
    with pytest.raises(UserError, match="other settings"):
        _run(corpus, tmp_path / "e", tmp_path / "runs", 10, True, ttt_steps=3)
    shard = sorted(corpus.glob("chat-*.jsonl.gz"))[-1]  # nor on other data
    lines = gzip.decompress(shard.read_bytes()).decode().splitlines(keepends=True)
    shard.write_bytes(gzip.compress("".join(lines[:-1]).encode(), mtime=0))
    with pytest.raises(UserError, match="trained on other data"):
        _run(corpus, tmp_path / "e", tmp_path / "runs", 10, True)


def test_a_restart_keeps_to_the_schedules_rules():
    """As a checkpoint is: a cosine run cannot be made longer; a wsd run only from before its decay."""
    saved = {"step": 40, "history": [], "path": "out"}
    wsd = LoopConfig(schedule="wsd", max_steps=50, warmup_steps=5)  # decays from step 40
    assert loop._continuable({**saved, "config": asdict(wsd)}, replace(wsd, max_steps=100), 100)["step"] == 40
    late = {**saved, "step": 45, "config": asdict(wsd)}
    with pytest.raises(UserError, match="no state from before step 80"):
        loop._continuable(late, replace(wsd, max_steps=100), 100)
    cosine = LoopConfig(max_steps=50)
    with pytest.raises(UserError, match="cosine"):
        loop._continuable({**saved, "config": asdict(cosine)}, replace(cosine, max_steps=100), 100)
    assert loop._continuable({**saved, "config": asdict(cosine)}, cosine, 100)["step"] == 40  # the same run
