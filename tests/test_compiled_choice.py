"""compile=auto on a CPU (mtp_viz.compiled_choice): compiled where it measured faster here, the
choice recorded once per machine and model shape; a model not built yet runs eager, and the build
is what the process allows (none for a library caller, in the foreground for the CLI, in a process
of its own for the app, stopped with it). Every choice decodes the same tokens."""

import json
import subprocess
import sys
from dataclasses import asdict, replace

import pytest
import torch
from conftest import decode, running, tiny_model
from optional import require
from test_mask_mtp import V, random_adapter
from torch._dynamo.utils import counters

from mtp_viz import compiled_choice, measured, paths, static
from mtp_viz.lean import compile_unavailable, lean_model
from mtp_viz.prepare import prepare_engine
from mtp_viz.strategies.base import GenerationSettings

pytestmark = pytest.mark.slow  # the tiny model's layer compiles once per suite (~40 s), shared with test_lean
PROMPT = [5, 17, 3, 42, 9, 17, 3]
GENERATION = GenerationSettings(max_new_tokens=12)


class Loaded:
    """What prepare_engine reads of a loaded model."""

    def __init__(self, model):
        self.model, self.linear, self.weights_detail = model, "stock", "fp32"


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """Choices recorded in a cache of the test's own (the suite's build cache, with its compiled layers, stays)."""
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path))
    yield tmp_path
    compiled_choice.allow_builds(compiled_choice.NONE)
    compiled_choice.stop_builds()


@pytest.fixture(scope="module")
def model():
    require(compile_unavailable(torch.device("cpu")) is None, "a C++ compiler for inductor", "apt-get install g++")
    return tiny_model("llama-2l", seed=1)


def test_a_library_caller_builds_nothing_and_runs_eager(model, own_cache, monkeypatch):
    monkeypatch.setattr(static, "build", lambda config: pytest.fail("built under allow_builds(NONE)"))
    engine = prepare_engine([Loaded(model)], "auto")
    assert not engine["compiled"] and "compile=on compiles" in engine["compile_note"]
    assert not lean_model(model).compiled and not list(own_cache.rglob("choice-*.json"))


def test_the_foreground_build_measures_once_records_and_decodes_the_same(model, own_cache, monkeypatch):
    eager = decode(model, "autoregressive", PROMPT, GENERATION)[0]
    compiled_choice.allow_builds(compiled_choice.FOREGROUND)
    engine = prepare_engine([Loaded(model)], "auto")
    (path,) = own_cache.rglob("choice-*.json")
    record = measured.read(path, compiled_choice.RECORD_VERSION)
    assert record["eager_ms"] > 0 and record["compiled_ms"] > 0
    assert record["compiled"] == (record["compiled_ms"] < record["eager_ms"])
    assert engine["compiled"] == record["compiled"] == lean_model(model).compiled
    assert "x eager" in engine["compile_note"]
    lean_model(model).compile()
    traced = dict(counters["stats"])  # dynamo's: frames traced, graphs made
    assert decode(model, "autoregressive", PROMPT, GENERATION)[0] == eager
    assert decode(model, "speculative", PROMPT, GENERATION, draft=model, num_draft_tokens=3)[0] == eager
    assert dict(counters["stats"]) == traced  # the compiled forward traces and recompiles nothing at run time
    torch.compile(lambda x: x * 2, backend="eager")(torch.ones(2))
    assert dict(counters["stats"]) != traced  # which the counters would have shown
    monkeypatch.setattr(compiled_choice, "measure", lambda lean, m: pytest.fail("measured again"))
    for said in (True, False):  # a later start reads the record, whatever it says
        measured.write(path, record | {"compiled": said})
        assert prepare_engine([Loaded(model)], "auto")["compiled"] is said
        assert lean_model(model).compiled is said
        assert decode(model, "autoregressive", PROMPT, GENERATION)[0] == eager
    lean_model(model).decompile()


def test_the_app_builds_in_a_process_of_its_own_and_stops_it(model, own_cache, monkeypatch):
    monkeypatch.setattr(static, "ready", lambda config: False)
    monkeypatch.setattr(
        compiled_choice, "build_command", lambda config: [sys.executable, "-c", "import time; time.sleep(60)"]
    )
    compiled_choice.allow_builds(compiled_choice.BACKGROUND)
    engine = prepare_engine([Loaded(model)], "auto")
    assert not engine["compiled"] and "being built in the background" in engine["compile_note"]
    (process,) = compiled_choice._building.values()
    prepare_engine([Loaded(model)], "auto")
    assert list(compiled_choice._building.values()) == [process]  # one build per config, not one per run
    compiled_choice.stop_builds()
    assert not running(process.pid)
    monkeypatch.setattr(compiled_choice, "build_command", lambda config: [sys.executable, "-c", "raise SystemExit(3)"])
    prepare_engine([Loaded(model)], "auto")
    (failed,) = compiled_choice._building.values()
    failed.wait(timeout=30)
    assert "exited with status 3" in prepare_engine([Loaded(model)], "auto")["compile_note"]  # said, not retried
    assert list(compiled_choice._building.values()) == [failed]


def test_the_app_builds_the_adapted_graph_beside_and_uses_it_once_built(own_cache, monkeypatch):
    """A mask-token view (LoRA adapters): its plain layer built, the app starts the adapted graph's
    build in a process of its own and serves the forwards with mask rows eager meanwhile; once the
    package is in the cache, the same engine loads and runs it (no restart), decoding the same."""
    view = random_adapter(tiny_model("llama-2l", seed=0, vocab_size=V, initializer_range=0.4))
    lean = lean_model(view)
    plain, _ = static.pack(lean)
    adapted, _ = static.pack(lean, adapted=True)
    assert adapted.lora and adapted.key() != plain.key()
    assert static.LayerConfig(**json.loads(json.dumps(asdict(adapted)))).key() == adapted.key()  # the build's argument
    static.build(plain)
    real_ready = static.ready
    monkeypatch.setattr(static, "ready", lambda config: not config.lora and real_ready(config))
    monkeypatch.setattr(
        compiled_choice, "build_command", lambda config: [sys.executable, "-c", "import time; time.sleep(60)"]
    )
    compiled_choice.allow_builds(compiled_choice.BACKGROUND)
    eager, _ = decode(view, "mask_spec", [3, 1, 5, 3, 1], GENERATION, mask_token_id=V, k=2)
    try:
        prepare_engine([Loaded(view)], "auto")
        assert adapted.key() in compiled_choice._building  # built beside
        lean.compile()
        assert not lean.static.adapted_ready()  # not built: the mask rows' forwards stay eager
        monkeypatch.setattr(static, "ready", real_ready)
        static.build(adapted)  # what the build process leaves in the cache
        assert lean.static.adapted_ready()
        out, _ = decode(view, "mask_spec", [3, 1, 5, 3, 1], GENERATION, mask_token_id=V, k=2)
        assert lean.compiled and out == eager
    finally:
        lean.decompile()


def test_the_build_process_builds_the_layer_its_argument_names(model):
    """`python -m mtp_viz.static CONFIG`, as the app starts it, for a layer not built yet (the tiny
    model's with a wider MLP): the process loads our kernels, compiles the layer from its config
    alone and exits 0; the package is then where a load looks for it."""
    config, _ = static.pack(lean_model(model))
    config = replace(config, intermediate=config.intermediate + 32)
    static.package_path(config).unlink(missing_ok=True)
    assert not static.ready(config)
    done = subprocess.run(compiled_choice.build_command(config), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert static.ready(config)
    static.package_path(config).unlink()
