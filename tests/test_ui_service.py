"""What the UI callbacks rely on, without a browser: requests from UI values, streaming with a
per-model lock, cancellation, concurrent runs, uploads, comparison verdicts and their diagnosis,
Explore's first look and the files the app hands out."""

import gc
import json
import subprocess
import sys
import threading
import time
from dataclasses import fields, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mtp_viz.errors import InvalidSettingsError, InvalidTraceError, UserError
from mtp_viz.quality import diagnose_divergence, lossless_verdict
from mtp_viz.runner import Run
from mtp_viz.trace import Trace
from mtp_viz.ui import jobs, trace_files
from mtp_viz.ui.baselines import as_baseline, baseline_key, request_baseline_key
from mtp_viz.ui.comparison import MAX_COMPARED, comparison_requests, uploaded_comparison
from mtp_viz.ui.measure import PROFILE_REPEATS, machine_profile_path, measure_machine
from mtp_viz.ui.requests import ANY_MODEL_ENV, build_request
from mtp_viz.ui.streaming import run_to_end, stream
from mtp_viz.ui.trace_files import read_uploaded_trace, trace_file


def test_build_request_keeps_only_the_strategy_settings(use_tiny_registry):
    r = build_request(
        "hi", "tiny", "autoregressive", draft="tiny-draft", max_new_tokens=12.0, num_draft_tokens=7, max_ngram_size=3
    )
    assert r.strategy_settings == {} and r.draft is None and r.generation.max_new_tokens == 12
    r = build_request("hi", "", "prompt_lookup", num_draft_tokens=7.0, max_ngram_size=4, min_ngram_size=1)
    assert r.model is None and r.strategy_settings == {"num_draft_tokens": 7, "max_ngram_size": 4, "min_ngram_size": 1}
    with pytest.raises(InvalidSettingsError, match="whole number"):
        build_request("hi", "tiny", "autoregressive", max_new_tokens=2.5)


def test_comparison_requests_put_autoregressive_first(use_tiny_registry):
    rs = comparison_requests(["prompt_lookup", "autoregressive", "prompt_lookup"], prompt="x", model="tiny")
    assert [r.strategy for r in rs] == ["autoregressive", "prompt_lookup"]
    with pytest.raises(UserError, match="at least one"):
        comparison_requests([], prompt="x", model="tiny")
    with pytest.raises(UserError, match="at most"):
        comparison_requests(["speculative", "prompt_lookup", "a", "b"][:MAX_COMPARED], prompt="x", model="tiny")


HOLD_LIMIT_S = 60.0  # a held run goes on by itself after this (and the test fails), never hangs


class Pace:
    """Decoding the test paces (fixture `paced`): while `holding`, a run in the background waits
    after each step until the test lets one more through (`next_step`) or its stream is stopped,
    so what a stream shows and when Stop lands do not depend on how fast this machine decodes."""

    def __init__(self):
        self.holding = False
        self.overran = False  # a run was held past HOLD_LIMIT_S: nothing let it go on
        self.runs: list[Run] = []
        self._gate = threading.Semaphore(0)
        self._job = threading.local()  # the background job's `stopped`, in its own thread

    def next_step(self) -> None:
        self._gate.release()

    def wait(self) -> None:
        stopped = getattr(self._job, "stopped", None)
        deadline = time.monotonic() + HOLD_LIMIT_S
        while self.holding and stopped is not None and not self._gate.acquire(timeout=0.01):
            if stopped():
                return
            if time.monotonic() > deadline:  # a broken stream would otherwise hang the test
                self.overran = True
                return

    def job(self, work):
        def spied(stopped):
            self._job.stopped = stopped
            return work(stopped)

        return spied


@pytest.fixture
def paced(monkeypatch):
    pace = Pace()
    real_steps, real_background = Run.steps, jobs.in_background

    def steps(run):
        pace.runs.append(run)
        for step in real_steps(run):
            yield step
            pace.wait()

    monkeypatch.setattr(Run, "steps", steps)
    monkeypatch.setattr(jobs, "in_background", lambda work, poll: real_background(pace.job(work), poll))
    monkeypatch.setattr(jobs, "STREAM_INTERVAL_S", 0.01)
    yield pace
    assert not pace.overran, "a held run was never released nor stopped"


def test_stream_yields_growing_snapshots_then_the_trace(use_tiny_registry, paced):
    """A snapshot per step while the run is held after each one, then the whole trace."""
    paced.holding = True
    snapshots = []
    for steps, trace in stream(build_request("the cat", "tiny", "autoregressive", max_new_tokens=8)):
        if trace is not None:
            break
        if not snapshots or len(steps) != len(snapshots[-1]):  # held: the same snapshot until released
            snapshots.append(steps)
            paced.next_step()
    assert trace.steps == steps and len(trace.steps) >= 2
    assert [len(s) for s in snapshots] == list(range(1, len(trace.steps) + 1))
    assert all(s == trace.steps[: len(s)] for s in snapshots)


def test_closing_a_stream_cancels_the_run_and_releases_the_model_lock(use_tiny_registry, paced):
    paced.holding = True
    gen = stream(build_request("the cat", "tiny", "autoregressive", max_new_tokens=400))
    steps, _ = next(gen)  # the run is held after its first step
    lock = jobs.lock_for("tiny")
    assert not lock.acquire(blocking=False)  # held while decoding
    gen.close()  # what Gradio does when Stop is pressed
    assert lock.acquire(blocking=False)
    lock.release()
    trace = paced.runs[-1].trace
    assert trace.stop_reason == "cancelled" and len(trace.steps) <= len(steps) + 1  # within one step


def test_errors_inside_the_decoding_thread_reach_the_caller(use_tiny_registry, monkeypatch):
    def broken(self):
        raise RuntimeError("boom")
        yield

    monkeypatch.setattr(Run, "steps", broken)
    with pytest.raises(RuntimeError, match="boom"):
        list(stream(build_request("the cat", "tiny", "autoregressive")))


def test_cancel_stops_after_the_current_step(use_tiny_registry):
    run = Run(build_request("the cat", "tiny", "autoregressive", max_new_tokens=50))
    for step in run.steps():
        if step.index == 2:
            run.cancel()
    assert run.trace.stop_reason == "cancelled" and len(run.trace.steps) == 3


def test_concurrent_runs_do_not_cross_talk(use_tiny_registry):
    prompts = ["the cat sat", "a bird sang a song", "the dog ran to the park", "def add ( a , b )"]
    requests = [
        build_request(p, "tiny", s, max_new_tokens=16)
        for p in prompts
        for s in ("autoregressive", "speculative", "prompt_lookup")
    ]
    alone = [run_to_end(r).output_token_ids for r in requests]
    together: list = [None] * len(requests)

    def work(i):
        together[i] = run_to_end(requests[i]).output_token_ids

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert together == alone


def test_uploads_are_size_limited_and_validated(tmp_path, monkeypatch):
    big = tmp_path / "big.json"
    big.write_text("x" * 200)
    monkeypatch.setattr(trace_files, "MAX_TRACE_BYTES", 100)
    with pytest.raises(InvalidTraceError, match="bytes"):
        read_uploaded_trace(str(big))
    monkeypatch.undo()
    cases = {"binary.json": b"\xff\xfe\x00", "truncated.json": b'{"schema_version": 1, "steps": [', "other.json": b"[]"}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(InvalidTraceError):
            read_uploaded_trace(str(tmp_path / name))
    with pytest.raises(InvalidTraceError):
        read_uploaded_trace(None)


class _TiedModel:
    """A stand-in target whose top two logits are `gap` apart."""

    device = torch.device("cpu")

    def __init__(self, gap):
        self.gap = gap

    def __call__(self, ids, logits_to_keep=1):
        logits = torch.zeros(1, 1, 8)
        logits[0, 0, 3], logits[0, 0, 5] = 10.0, 10.0 - self.gap
        return SimpleNamespace(logits=logits)


def test_divergence_diagnosis_tells_a_near_tie_from_a_bug():
    near = diagnose_divergence(_TiedModel(1e-5), [1, 2], [4, 3, 3], [4, 5, 3])
    assert near.position == 1 and near.near_tie and "near-tie" in near.explain()
    bug = diagnose_divergence(_TiedModel(2.0), [1, 2], [4, 3, 3], [4, 5, 3])
    assert not bug.near_tie and "bug" in bug.explain()
    assert diagnose_divergence(_TiedModel(2.0), [1], [4, 3], [4, 3]) is None


def test_lossless_verdict_lines(use_tiny_registry):
    a = run_to_end(build_request("the cat", "tiny", "autoregressive", max_new_tokens=8))
    b = run_to_end(build_request("the cat", "tiny", "prompt_lookup", max_new_tokens=8))
    assert lossless_verdict(a, b) == "identical to autoregressive"
    b.output_token_ids = b.output_token_ids[:3] + [0] + b.output_token_ids[4:]
    assert "token 3" in lossless_verdict(a, b)
    sampled = run_to_end(build_request("the cat", "tiny", "prompt_lookup", temperature=1.0))
    assert "distribution check" in lossless_verdict(a, sampled)


def test_uploaded_traces_compare_with_autoregressive_first(use_tiny_registry, tmp_path):
    paths = []
    for s in ("prompt_lookup", "autoregressive"):
        t = run_to_end(build_request("the cat sat", "tiny", s, max_new_tokens=6))
        paths.append(trace_file(t))
    traces = uploaded_comparison(paths)
    assert [t.strategy for t in traces] == ["autoregressive", "prompt_lookup"]
    with pytest.raises(UserError, match="autoregressive"):
        uploaded_comparison([paths[0], paths[0]])
    with pytest.raises(UserError, match="upload 2"):
        uploaded_comparison(paths[:1])


def test_the_app_loads_registered_models_only(use_tiny_registry, tmp_path, monkeypatch):
    """A path on the server's disk or an unregistered id is refused before anything loads."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    for name in (str(model_dir), "/etc", "../models", "someone/some-model"):
        with pytest.raises(UserError, match="registry"):
            build_request("hi", name, "autoregressive")
        with pytest.raises(UserError, match="registry"):
            build_request("hi", "tiny", "speculative", draft=name)
    monkeypatch.setenv(ANY_MODEL_ENV, "1")
    assert build_request("hi", "someone/some-model", "autoregressive").model == "someone/some-model"
    with pytest.raises(UserError, match="registry"):  # still never a local path
        build_request("hi", str(model_dir), "autoregressive")


def _live(cls) -> int:
    gc.collect()
    return sum(isinstance(o, cls) for o in gc.get_objects())


def test_finished_and_stopped_runs_free_their_caches(use_tiny_registry, paced):
    """No KV cache outlives its run: after runs to the end, a cancelled run and a stream closed
    by Stop, no cache object is alive (a leak would grow memory with every run)."""
    from transformers.cache_utils import Cache

    from mtp_viz.cache import CachedModel

    before = (_live(CachedModel), _live(Cache))
    for strategy in ("autoregressive", "speculative", "prompt_lookup", "lookahead", "self_speculative"):
        settings = {"exit_layer": 1} if strategy == "self_speculative" else {}
        run_to_end(build_request("the cat sat", "tiny", strategy, max_new_tokens=12, settings=settings))
    run = Run(build_request("the cat", "tiny", "speculative", max_new_tokens=50))
    for step in run.steps():
        if step.index == 2:
            run.cancel()
    paced.holding = True
    gen = stream(build_request("the cat", "tiny", "autoregressive", max_new_tokens=400))
    next(gen)  # held after its first step
    gen.close()
    assert paced.runs[-1].trace.stop_reason == "cancelled"
    paced.runs.clear()
    del run, gen
    assert (_live(CachedModel), _live(Cache)) == before


def test_measure_this_machine_writes_a_labelled_profile_and_stops_when_closed(use_tiny_registry, tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_VIZ_CACHE", str(tmp_path))
    from mtp_viz.profile import read_profile

    updates = list(measure_machine())
    done, total, path = updates[-1]
    assert done == total == PROFILE_REPEATS and path == machine_profile_path()
    assert all(p is None for *_, p in updates[:-1])
    data = json.loads(path.read_text())
    assert data["machine"]["cpu"] and data["machine"]["forward"] == "lean" and data["c"] is not None
    assert read_profile(path).curve[1] == 1.0
    path.unlink()
    stopped = measure_machine()
    next(stopped)
    stopped.close()  # the Stop button: the measurement ends, nothing is written
    assert not path.exists()


def test_explore_defaults_to_the_strategy_that_shows_the_idea_and_measures_its_own_baseline(use_tiny_registry):
    from mtp_viz.registry import load_registry
    from mtp_viz.ui.explore import default_strategy

    registry = load_registry()
    assert default_strategy(registry, "tiny") == "speculative"  # it has a draft, no heads
    assert default_strategy(registry, "tiny-markup") == "prompt_lookup"  # nothing trained: n-grams
    request = build_request("the cat sat", "tiny", "prompt_lookup", max_new_tokens=6)
    base = run_to_end(as_baseline(request))
    assert base.strategy == "autoregressive" and base.settings["max_new_tokens"] == 6
    assert request_baseline_key(request) == baseline_key(base)  # found again, not re-run
    other = build_request("the dog ran", "tiny", "prompt_lookup", max_new_tokens=6)
    assert request_baseline_key(other) != baseline_key(base)


def test_the_embedded_model_opens_on_its_mtp_heads():
    from mtp_viz.registry import load_registry
    from mtp_viz.ui.explore import default_strategy

    registry = load_registry()  # the shipped models.yaml
    assert default_strategy(registry, registry.default_for("cpu")) == "mtp_heads"


def test_deploy_costs_come_from_the_loaded_models(use_tiny_registry):
    """A draft model costs its own parameters and its KV cache at the run's length; prompt lookup
    and autoregressive decoding cost nothing extra; the /compare metrics rows carry both figures."""
    from mtp_viz.deploy import deploy_costs, kv_cache_bytes
    from mtp_viz.loading import load_model
    from mtp_viz.ui.app import api_compare

    traces = [
        run_to_end(build_request("the cat sat", "tiny", s, max_new_tokens=8))
        for s in ("autoregressive", "prompt_lookup", "speculative")
    ]
    base, lookup, spec = deploy_costs(traces)
    draft = load_model("tiny-draft").model
    params = sum(p.numel() for p in draft.parameters())
    length = len(traces[2].prompt_token_ids) + len(traces[2].output_token_ids)
    assert spec.extra_models == 1 and spec.extra_params == params
    expected_mb = (params * 4 + kv_cache_bytes(draft, length)) / 2**20
    assert spec.extra_memory_mb == pytest.approx(expected_mb, abs=1e-3)
    assert spec.draft_forwards_per_token > 0 and "off-the-shelf" in spec.training
    assert base.extra_params == lookup.extra_params == 0 and base.extra_memory_mb == 0.0
    assert base.target_forwards_per_token == 1.0
    rows = api_compare("the cat sat", ["speculative"], model="tiny", max_new_tokens=6)["metrics"]
    assert rows[0]["extra_params"] == 0 and rows[1]["extra_params"] == params and rows[1]["extra_memory_mb"] > 0


def test_the_first_look_has_the_speedup_over_the_autoregressive_run_recorded_beside_it():
    """Explore's recorded example is paired with the autoregressive run of the same prompt and
    settings recorded on the same machine in the same session; a run from elsewhere never is."""
    from mtp_viz.machine import machine_label, same_machine
    from mtp_viz.ui.first_look import FIRST_LOOK, note_html, open_example, recorded_baseline, recorded_speed
    from mtp_viz.ui.results import example_traces
    from mtp_viz.viz.tables import summary_html

    examples = example_traces()
    look = open_example(FIRST_LOOK, examples)
    assert look.baseline is not None and look.baseline.strategy == "autoregressive"
    assert look.baseline.prompt_token_ids == look.trace.prompt_token_ids and same_machine(
        look.baseline.machine, look.trace.machine
    )
    speedup = look.trace.summary["tokens_per_s"] / look.baseline.summary["tokens_per_s"]
    shown = summary_html(look.trace, recorded_speed(look).get(baseline_key(look.trace)))
    assert f"speedup vs autoregressive</div><div style='font-size:20px;font-weight:600'>{speedup:.2f}x" in shown
    assert machine_label(look.trace.machine) in note_html(look) and "recorded beside it" in note_html(look)
    elsewhere = replace(look.trace, machine={**look.trace.machine, "cpu": "Another CPU"})
    assert recorded_baseline(elsewhere, examples) is None
    longer = replace(look.trace, settings={**look.trace.settings, "max_new_tokens": 97})
    assert recorded_baseline(longer, examples) is None


def test_explore_starts_from_the_first_looks_own_strategy_settings_and_prompt(monkeypatch):
    """The controls hold what the example ran (its model and drafter registered), so Run repeats it."""
    import gradio as gr

    from mtp_viz.registry import REGISTRY_ENV, load_registry
    from mtp_viz.strategies import STRATEGIES
    from mtp_viz.ui.controls import build_controls
    from mtp_viz.ui.explore import starting_values
    from mtp_viz.ui.first_look import FIRST_LOOK, open_example
    from mtp_viz.ui.results import example_traces

    monkeypatch.delenv(REGISTRY_ENV, raising=False)  # the shipped models.yaml: the example's model and heads
    trace = open_example(FIRST_LOOK, example_traces()).trace
    start = starting_values(load_registry(), "smollm2-135m", trace)
    assert start["strategy"] == trace.strategy == "mtp_heads" and start["prompt"] == trace.prompt_text
    assert start["model"] == trace.model
    generation = {k: start[k] for k in ("max_new_tokens", "temperature", "top_k", "top_p", "seed")}
    request = build_request(
        start["prompt"],
        start["model"],
        start["strategy"],
        start["draft"],
        start["raw"],
        start["settings"],
        weights=start["weights"],
        **generation,
    )
    assert request.strategy_settings == {k: trace.settings[k] for k in request.strategy_settings}
    owned = {f.name for f in fields(STRATEGIES["mtp_heads"].settings_cls)}
    assert set(request.strategy_settings) == owned and {"tree", "num_guesses"} <= owned
    assert {k: getattr(request.generation, k) for k in generation} == {k: trace.settings[k] for k in generation}
    assert request.weights == trace.settings["weights"]
    with gr.Blocks():
        made = build_controls(start["strategy"], start["settings"])
    assert {name for name, control in made.items() if control.visible} == owned
    assert all(made[name].value == trace.settings[name] for name in owned)


def test_explore_starts_from_a_strategy_the_model_can_run(use_tiny_registry):
    """Where the example's model is not registered (or lacks its drafter), the controls keep its
    prompt and generation settings but start on what the model here can draft with."""
    from mtp_viz.registry import load_registry
    from mtp_viz.ui.explore import DEFAULT_PROMPT, default_strategy, runs_here, starting_values
    from mtp_viz.ui.first_look import FIRST_LOOK, open_example
    from mtp_viz.ui.results import example_traces

    registry = load_registry()
    trace = open_example(FIRST_LOOK, example_traces()).trace
    assert not registry.models["tiny"].heads and registry.models["tiny"].drafts
    start = starting_values(registry, "tiny", trace)
    assert start["model"] == "tiny" and start["strategy"] == default_strategy(registry, "tiny") == "speculative"
    assert start["settings"] == {} and start["draft"] == "tiny-draft" and start["prompt"] == trace.prompt_text
    assert start["max_new_tokens"] == trace.settings["max_new_tokens"]
    assert runs_here(registry, "tiny", "prompt_lookup", {}) and runs_here(registry, "tiny", "speculative", {})
    assert not runs_here(registry, "tiny", "mtp_heads", {}) and not runs_here(registry, "tiny", "eagle", {})
    assert not runs_here(registry, "unregistered", "mtp_heads", {})
    assert starting_values(registry, "tiny", None)["prompt"] == DEFAULT_PROMPT  # no example: the defaults


def test_downloads_are_written_once_per_content_into_one_folder_removed_at_exit():
    from mtp_viz.ui.first_look import FIRST_LOOK
    from mtp_viz.ui.results import example_traces
    from mtp_viz.ui.temp_files import app_temp_dir

    trace = Trace.load(example_traces()[FIRST_LOOK])
    first, again = trace_file(trace), trace_file(trace)
    assert first == again and Path(first).is_relative_to(app_temp_dir())  # every page load's first look: one file
    other = trace_file(replace(trace, prompt_text="another prompt"))
    assert other != first and Path(other).name == Path(first).name and Path(first).is_file()
    script = "from mtp_viz.ui.temp_files import download_file; print(download_file('t.csv', 'a,b'), flush=True)"
    killed = subprocess.run(
        [sys.executable, "-c", f"{script}; import os; os.kill(os.getpid(), 9)"], capture_output=True
    )
    orphan = Path(killed.stdout.decode().strip()).parent.parent
    assert orphan.name.startswith("mtp-viz-app-") and orphan.exists()  # killed: no exit handler ran
    ended = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    folder = Path(ended.stdout.strip()).parent.parent
    assert not folder.exists()  # removed when its process ended
    assert not orphan.exists()  # and the killed one's, by the next app process
