"""The training corpus (mtp_viz.training.corpus): prompts from local sources with held-out overlaps
dropped, the target's own answers in shards, a build that stops resumes where it stopped, the
validation split drawn by source key, and answers from a vLLM server started and stopped by the
build. The tiny target stands in for the real one; its answers are checked against a direct run."""

import json
from dataclasses import replace

import pytest
from conftest import EMBEDDED, gone
from fake_vllm import HASHED

from mtp_viz.cli import main
from mtp_viz.errors import UserError
from mtp_viz.loading.spec import load_spec
from mtp_viz.prompts import spec_bench
from mtp_viz.runner import RunRequest, run
from mtp_viz.serving.backend import served_target
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.training import corpus, corpus_make
from mtp_viz.training.corpus import (
    CHAT,
    FIRST,
    MANIFEST,
    SUBJECTS,
    TRAIN,
    VALIDATION,
    CorpusConfig,
    is_complete,
    read_records,
)
from mtp_viz.training.corpus_make import make
from mtp_viz.training.corpus_sources import STOPWORDS, CorpusPrompt, Dedup, subject_prompts, subject_words, user

SMALL = CorpusConfig(
    templates=5, code=4, documents=3, math=2, chat=3, subjects=0, max_new_tokens=4, shard_size=4, validation_share=0.5
)
WORDS = ["water", "school", "music", "garden", "river", "market"]
ONE_STAGE = {"code": 0, "documents": 0, "math": 0, "chat": 0, "subjects": 0, "max_new_tokens": 2}


def test_a_prompt_that_copies_a_held_out_question_is_dropped_and_so_is_a_repeat():
    question = spec_bench()[0]["turns"][0]
    dedup = Dedup()
    assert not dedup.keep(CorpusPrompt("templates", "k", user(f"Please answer this: {question}")))
    fresh = CorpusPrompt("templates", "k", user("Describe the water cycle to a child in two short paragraphs."))
    assert dedup.keep(fresh) and not dedup.keep(fresh)
    assert dedup.dropped == {"held-out overlap": 1, "repeat": 1}


def test_a_build_writes_shards_resumes_where_it_stopped_and_splits_by_key(use_tiny_registry, tmp_path, monkeypatch):
    asked: list[int] = []
    real = corpus_make.answer_with_ours

    def counting(*args, **kwargs):
        answer = real(*args, **kwargs)
        return lambda items: asked.append(len(items)) or answer(items)

    monkeypatch.setattr(corpus_make, "answer_with_ours", counting)
    monkeypatch.setattr(corpus_make, "build", _stopping_after(corpus_make.build, 1))
    folder, stopped = make("tiny", tmp_path / "c", SMALL, engine=corpus_make.OURS)
    assert not stopped.get("complete") and len(stopped["shards"]) == 1 and asked == [4]
    first_shard = (folder / "first-00000.jsonl.gz").read_bytes()

    monkeypatch.setattr(corpus_make, "build", corpus_make.build.__wrapped__)
    folder, manifest = make("tiny", tmp_path / "c", SMALL, engine=corpus_make.OURS)
    assert manifest["complete"] and (folder / "first-00000.jsonl.gz").read_bytes() == first_shard  # not asked again
    first, chat = list(read_records(folder, FIRST)), list(read_records(folder, CHAT))
    assert len(first) == 14 and sum(asked) == len(first) + len(chat)  # every prompt answered once, in all
    assert {r["source"] for r in first} == {"templates", "code", "documents", "math"}
    assert 1 <= len(chat) <= SMALL.chat and all(len(r["messages"]) == 3 for r in chat)
    assert manifest["answer_tokens"] == sum(len(r["answer_ids"]) for r in first + chat)
    assert manifest["engines"] == [{"engine": "mtp-viz"}] and manifest["config"]["shard_size"] == 4

    # the validation split is drawn by key: a document, module or topic on one side only
    sides = {}
    for r in first + chat:
        sides.setdefault(r["key"], set()).add(r["split"])
    assert all(len(s) == 1 for s in sides.values())
    assert {r["split"] for r in first} == {TRAIN, VALIDATION}
    assert all(r["split"] == sides[r["key"]].copy().pop() for r in chat)  # a second turn on its first's side

    # the answers are the target's: greedy ones are what a direct run of our engine gives
    greedy = next(r for r in first if r["temperature"] == 0.0)
    trace = run(RunRequest(prompt_ids=tuple(greedy["prompt_ids"]), model="tiny", generation=GenerationSettings(4)))
    assert greedy["answer_ids"] == trace.output_token_ids


def test_a_folder_made_with_other_settings_is_refused(use_tiny_registry, tmp_path):
    make("tiny", tmp_path, CorpusConfig(templates=2, **ONE_STAGE), "ours")
    with pytest.raises(UserError, match="made otherwise"):
        make("tiny", tmp_path, CorpusConfig(templates=3, **ONE_STAGE), "ours")


def test_a_finished_corpus_made_before_subjects_existed_is_extended_by_them(use_tiny_registry, tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "subject_words", lambda tokenizer, limit: WORDS)  # the tiny vocabulary has one
    folder, _ = make("tiny", tmp_path, SMALL, "ours")
    manifest = json.loads((folder / MANIFEST).read_text())
    del manifest["config"]["subjects"]  # as a corpus made before the stage existed says
    (folder / MANIFEST).write_text(json.dumps(manifest))
    before = {p.name: p.read_bytes() for p in folder.glob("*.jsonl.gz")}

    extend = replace(SMALL, subjects=6)  # stopped after its first shard of two
    monkeypatch.setattr(corpus_make, "build", _stopping_after(corpus_make.build, 1))
    with pytest.raises(UserError, match="made otherwise"):  # the stages before it never change
        make("tiny", tmp_path, replace(extend, templates=6), "ours")
    folder, stopped = make("tiny", tmp_path, extend, "ours")
    assert not stopped.get("complete") and not is_complete(folder)  # nothing reads a half-extended corpus
    with pytest.raises(UserError, match="made otherwise"):  # once the stage has begun, its size is fixed
        make("tiny", tmp_path, replace(extend, subjects=5), "ours")
    monkeypatch.setattr(corpus_make, "build", corpus_make.build.__wrapped__)
    folder, extended = make("tiny", tmp_path, extend, "ours")
    assert extended["complete"] and extended["config"]["subjects"] == 6
    assert all((folder / name).read_bytes() == data for name, data in before.items())  # not made again
    subjects = list(read_records(folder, SUBJECTS))
    assert len(subjects) == 6 and {r["source"] for r in subjects} == {"subjects"}
    assert {r["key"] for r in subjects} == {f"topic:{w}" for w in WORDS} and all(r["answer_ids"] for r in subjects)
    assert {r["split"] for r in subjects} == {TRAIN, VALIDATION}  # by word
    assert extended["answer_tokens"] == sum(len(r["answer_ids"]) for r in read_records(folder))


def test_a_stage_resumed_where_its_prompts_differ_is_refused(use_tiny_registry, tmp_path, monkeypatch):
    """Prompts depend on the machine (its standard library, its packages): a stage begun on one
    and resumed on another would repeat or skip prompts at the shard boundary."""
    cfg = CorpusConfig(templates=0, **(ONE_STAGE | {"subjects": 6}), shard_size=4)
    monkeypatch.setattr(corpus, "subject_words", lambda tokenizer, limit: WORDS)
    monkeypatch.setattr(corpus_make, "build", _stopping_after(corpus_make.build, 1))
    make("tiny", tmp_path, cfg, "ours")
    monkeypatch.setattr(corpus_make, "build", corpus_make.build.__wrapped__)
    monkeypatch.setattr(corpus, "subject_words", lambda tokenizer, limit: WORDS[::-1])
    with pytest.raises(UserError, match="differ from those"):
        make("tiny", tmp_path, cfg, "ours")


def test_subjects_are_the_tokenizers_common_whole_words_one_key_each():
    tokenizer = served_target(load_spec(EMBEDDED, "cpu", "float32")).tokenizer
    words = subject_words(tokenizer, 400)
    assert len(words) == 400 and {"school", "health", "water", "children"} <= set(words)
    assert not {"includ", "differe", "produ", "experi"} & set(words)  # BPE word pieces are not words
    assert not STOPWORDS & set(words) and all(
        len(tokenizer.encode(f" {w}", add_special_tokens=False)) == 1 for w in words
    )
    prompts = subject_prompts(60, 0, words)
    keys = [p.key for p in prompts]
    assert len(set(keys)) == 60 and all(p.key.removeprefix("topic:") in p.text for p in prompts)
    assert len({p.text.replace(p.key.removeprefix("topic:"), "{}") for p in prompts}) > 8  # many genres


def test_a_vllm_build_starts_its_server_and_stops_it(use_tiny_registry, fake_vllm, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_VLLM_TOKENS", HASHED)
    main(["train", "corpus", "--model", "tiny", "--data", str(tmp_path), "--engine", "vllm", "--prompts", "6"])
    assert "answer tokens" in capsys.readouterr().out
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["complete"] and manifest["engines"][0]["engine"] == "vllm"
    records = list(read_records(tmp_path))
    assert records and all(r["answer_ids"] for r in records)
    assert gone(json.loads(fake_vllm.read_text()))  # the server and its engine child


def _stopping_after(build, shards: int):
    def stopping(*args, **kwargs):
        return build(*args, **kwargs, stop_after_shards=shards)

    stopping.__wrapped__ = build
    return stopping
