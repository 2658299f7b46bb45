"""Tiny random models built from a config here, so engine tests need no weights and no network."""

import copy
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch
from crash_safe import pytest_runtest_protocol, pytest_xdist_make_scheduler  # noqa: F401 (hooks: a crash or hang fails by name)
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from mtp_viz.clock import Clock
from mtp_viz.gguf_codes import CACHE_VERSION as CODES_VERSION
from mtp_viz.loading.sources import CONVERTED_FROM
from mtp_viz.paths import BUILD_ENV, CACHE_ENV, build_root, cache_root
from mtp_viz.registry import load_registry
from mtp_viz.serving.server import PYTHON_ENV
from mtp_viz.strategies import STRATEGIES
from mtp_viz.strategies.base import DecodeContext, GenerationSettings
from mtp_viz.training.corpus import CorpusConfig
from mtp_viz.training.corpus_make import OURS, make

SUITE_CACHE_ENV = "MTP_VIZ_SUITE_CACHE"  # this run's cache folder (suite_cache), inherited by its workers
CODES_FOLDER = "weights"  # where mtp_viz.gguf_codes keeps a GGUF's 4-bit codes in the cache

TINY_CONFIGS = {
    "llama-2l": (
        LlamaForCausalLM,
        LlamaConfig,
        dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64),
    ),
    "llama-3l-mha": (
        LlamaForCausalLM,
        LlamaConfig,
        dict(hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96),
    ),
    "qwen2-2l": (
        Qwen2ForCausalLM,
        Qwen2Config,
        dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64),
    ),
}


def tiny_model(name: str = "llama-2l", seed: int = 0, vocab_size: int = 96, **overrides):
    model_cls, config_cls, kw = TINY_CONFIGS[name]
    torch.manual_seed(seed)
    config = config_cls(
        vocab_size=vocab_size,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **{**kw, **overrides},
    )
    return model_cls(config).eval()


def perturbed(model, noise: float, seed: int = 1):
    """A draft that agrees with `model` often but not always: weights + relative Gaussian noise."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    return draft


def decode(
    model,
    strategy: str,
    prompt_ids,
    generation=None,
    draft=None,
    eos=(),
    vocab_size=None,
    heads=None,
    mask_token_id=None,
    eagle3=None,
    **settings,
):
    """Run a strategy directly on a model; returns (output ids, steps)."""
    generation = generation or GenerationSettings(max_new_tokens=32)
    spec = STRATEGIES[strategy]
    ctx = DecodeContext(
        target=model,
        draft=draft,
        heads=heads,
        eagle3=eagle3,
        mask_token_id=mask_token_id,
        prompt_ids=list(prompt_ids),
        generation=generation,
        eos_token_ids=frozenset(eos),
        vocab_size=vocab_size or model.config.vocab_size,
        clock=Clock(),
        generator=None if generation.warp.greedy else torch.Generator(model.device).manual_seed(generation.seed),
    )
    steps = list(spec.run(ctx, spec.settings_cls(**settings)))
    return ctx.output, steps


def hf_greedy(model, prompt_ids, max_new_tokens: int, eos=None) -> list[int]:
    """transformers' own greedy decoding: the outside oracle."""
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    out = out[0, ids.shape[1] :].tolist()
    if eos is not None and eos in out:  # generate pads after EOS
        out = out[: out.index(eos) + 1]
    return out


class OracleHeads:
    """Scripted MTP heads for engine tests: they know a reference continuation and guess it, but
    put a wrong token first at every `wrong_every`-th position (the right one second), so chains
    break and trees win on a non-first branch. Once a path leaves the reference they guess junk.

    They speak the heads interface (`step`, `logits`): a predicted hidden state is a marker row
    [MARK, position, lost]; the target's real hidden states are mapped to positions by nearest
    neighbour in a table of the target's own hidden states along the reference.
    """

    MARK = 12345.0

    def __init__(self, model, prompt, reference, wrong_every: int = 3, confidence: float = 3.0):
        self.seq = list(prompt) + list(reference)
        self.vocab = model.config.vocab_size
        self.wrong_every = wrong_every
        self.confidence = confidence
        with torch.no_grad():
            self.table = model.get_decoder()(torch.tensor([self.seq])).last_hidden_state[0]  # (L, H)

    def step(self, hidden, tokens):
        rows = []
        for h, t in zip(hidden, tokens.tolist(), strict=True):
            if h[0] == self.MARK:
                position, lost = int(h[1]) + 1, bool(h[2])
            else:  # the target's hidden at t produced the token at t+1
                position, lost = int(torch.cdist(h[None], self.table).argmin()) + 1, False
            lost = lost or position >= len(self.seq) or self.seq[position] != t
            row = torch.zeros_like(h)
            row[0], row[1], row[2] = self.MARK, position, float(lost)
            rows.append(row)
        return torch.stack(rows)

    def logits(self, hidden):
        out = torch.zeros(len(hidden), self.vocab)
        for r, h in enumerate(hidden):
            position, lost = int(h[1]), bool(h[2])
            if lost or position + 1 >= len(self.seq):
                out[r, (position * 7) % self.vocab] = self.confidence
                continue
            right = self.seq[position + 1]
            wrong = (right + 1) % self.vocab
            first, second = (wrong, right) if position % self.wrong_every == 0 else (right, wrong)
            out[r, first] = self.confidence
            out[r, second] = self.confidence - 1.0
            out[r, (right + 2) % self.vocab] = self.confidence - 2.0
        return out


TEXT = "the cat sat on the mat and the dog ran to the park where a bird sang a song def add ( a , b ) : return a + b"
WORDS = TEXT.split()


def make_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<eos>": 1, "<user>": 2, "<assistant>": 3}
    for w in dict.fromkeys(WORDS):
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.chat_template = "{% for m in messages %}<user> {{ m['content'] }} {% endfor %}<assistant>"
    return fast


MARKUP = ["<img src=x onerror=alert(1)>", "<script>alert(2)</script>", "<b>bold</b>"]


def save_markup_dir(path: Path) -> Path:
    """A tiny model whose vocabulary has markup tokens and whose head scores only those (random
    logits, 0 elsewhere), so most tokens it writes are markup: the UI must show them as text."""
    tok = make_tokenizer()
    tok.add_tokens(MARKUP)
    model = tiny_model("llama-2l", seed=3, vocab_size=len(tok))
    ids = tok.convert_tokens_to_ids(MARKUP)
    with torch.no_grad():
        keep = model.lm_head.weight[ids].clone()
        model.lm_head.weight.zero_()
        model.lm_head.weight[ids] = keep * 50
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def save_tiny_dir(
    path: Path, model_name: str = "llama-2l", seed: int = 0, noise: float | None = None, tokenizer=None
) -> Path:
    tok = tokenizer or make_tokenizer()
    model = tiny_model(model_name, seed=seed, vocab_size=len(tok))
    if noise is not None:
        model = perturbed(model, noise)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_registry(tmp_path_factory):
    """A models.yaml with a tiny target and a tiny draft (same tokenizer) as local directories."""
    root = tmp_path_factory.mktemp("tiny-models")
    save_tiny_dir(root / "target")
    save_tiny_dir(root / "draft", noise=0.2)
    other = make_tokenizer()
    other.add_tokens(["extra"])
    save_tiny_dir(root / "other-vocab", tokenizer=other)
    save_markup_dir(root / "markup")
    registry = {
        "defaults": {"cpu": "tiny", "cuda": "tiny"},
        "models": [
            {
                "id": "tiny",
                "label": "Tiny",
                "chat": True,
                "sources": [{"kind": "local", "path": "target"}],
                "drafts": ["tiny-draft"],
            },
            {"id": "tiny-draft", "label": "Tiny draft", "sources": [{"kind": "local", "path": "draft"}]},
            {"id": "tiny-other", "label": "Other vocab", "sources": [{"kind": "local", "path": "other-vocab"}]},
            {"id": "tiny-markup", "label": "Markup tokens", "sources": [{"kind": "local", "path": "markup"}]},
        ],
    }
    path = root / "models.yaml"
    path.write_text(json.dumps(registry))  # JSON is YAML
    return path


@pytest.fixture
def use_tiny_registry(tiny_registry, monkeypatch):
    monkeypatch.setenv("MTP_VIZ_MODELS", str(tiny_registry))
    return tiny_registry


@pytest.fixture
def tiny_corpus(use_tiny_registry, tmp_path) -> Path:
    """A corpus of the tiny target's answers made by our engine (both sides of the split, two
    shards of first turns and one of second turns): what the trainers of a corpus read."""
    cfg = CorpusConfig(
        templates=4,
        code=2,
        documents=2,
        math=2,
        chat=2,
        subjects=0,
        max_new_tokens=6,
        shard_size=8,
        validation_share=0.4,
    )
    return make("tiny", tmp_path / "corpus", cfg, OURS)[0]


@pytest.fixture(scope="module")
def served_blocks(tiny_registry):
    """The whole Gradio app, launched in this process on a free local port, with the tiny models as
    its registry."""
    os.environ["MTP_VIZ_MODELS"] = str(tiny_registry)
    from mtp_viz.ui.app import build_app

    app = build_app().queue()
    app.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
    try:
        yield app
    finally:
        app.close()
        del os.environ["MTP_VIZ_MODELS"]


@pytest.fixture(scope="module")
def served_app(served_blocks) -> str:
    """The served app's URL."""
    return served_blocks.local_url


def wait_until_idle(app, stable_s: float = 1.0, timeout_s: float = 120.0) -> None:
    """Wait until a served app has no event queued or running, `stable_s` on end: every handler
    that a page load or a click started has finished (one a hidden tab runs too)."""
    idle_since = None

    def idle() -> bool:
        nonlocal idle_since
        busy = len(app._queue) > 0 or app._queue.get_active_worker_count() > 0
        idle_since = None if busy else (idle_since or time.monotonic())
        return idle_since is not None and time.monotonic() - idle_since >= stable_s

    if not until(idle, timeout_s):
        pytest.fail(f"the app was still busy after {timeout_s:.0f} s", pytrace=False)


def pytest_configure(config):
    """Under pytest-xdist (the suite runs a worker per core) each worker runs torch on one thread:
    two workers of two threads each on two cores would only queue behind each other. Every test
    runs on the suite's own cache folder (suite_cache)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
    suite_cache(config)
    read_recorded_weight_choice()


# What `weights=auto` measured for the embedded model on the project's 2-core AMD EPYC (one-token
# forward, ms; agreement with fp32's greedy tokens on the held-out prompts): q4, the fastest of
# those above the floor, lossless there. A run of the embedded model in `auto` (the default) reads
# this instead of measuring a choice (13 prompts × 64 tokens in each format: ~3 min, on each worker
# that meets it first). Measuring is tests/test_weights_auto.py's, on a tiny model.
EMBEDDED = "smollm2-135m"
RECORDED_CHOICE = "q4"
RECORDED = {"fp32": (None, 141.6), "bf16": (0.9892, 105.9), "int8": (0.9688, 95.1), "q4": (0.9904, 87.8)}


def recorded_weight_choice() -> dict:
    """RECORDED as mtp_viz.weights_auto keeps a measured choice."""
    from mtp_viz import weights_auto

    formats = {
        fmt: {"forward_ms": ms, "spread": 0.0, "lossless": True, **({} if agree is None else {"agreement": agree})}
        for fmt, (agree, ms) in RECORDED.items()
    }
    return {
        "version": weights_auto.RECORD_VERSION,
        "chosen": RECORDED_CHOICE,
        "settled": True,
        "formats": formats,
        "floor": weights_auto.AGREEMENT_FLOOR,
        "measured_at": "2026-12-05T20:00:00+00:00",
        "load_average": None,
        "recorded": "on the project's AMD EPYC by the test suite (tests/conftest.py), not measured here",
    }


def read_recorded_weight_choice() -> None:
    """The embedded model's `auto` choice, when the suite's cache has none, is RECORDED (saved
    there, so every later load reads it as it would a measurement)."""
    from mtp_viz import weights_auto

    cached_record = weights_auto.cached_record

    def recorded_or_cached(name: str, model) -> dict | None:
        record = cached_record(name, model)
        if record is None and name == EMBEDDED:
            record = recorded_weight_choice()
            weights_auto.save_record(name, model, record)
        return record

    weights_auto.cached_record = recorded_or_cached


def suite_cache(config) -> None:
    """Point MTP_VIZ_CACHE at a folder of this run's own, so that no result depends on what an
    earlier run, or the user, left in the cache: the run's first process (pytest-xdist's
    controller, or the only one) makes it, its workers inherit it through SUITE_CACHE_ENV and
    share it (what one measures or converts, the others reuse), and the maker deletes it at the
    end. Measured records (kernel and row plans, the weight format chosen) start empty; only the
    files that are functions of a shipped GGUF alone are seeded from the user's cache
    (seed_from), as the app itself would reuse them."""
    given = os.environ.get(SUITE_CACHE_ENV)
    if given:
        os.environ[CACHE_ENV] = given
        os.environ[BUILD_ENV] = str(Path(given) / "build")
        return
    folder = Path(tempfile.mkdtemp(prefix="mtp-viz-suite-cache-"))
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    seed_from(cache_root(), build_root(), folder)
    os.environ[SUITE_CACHE_ENV] = os.environ[CACHE_ENV] = str(folder)
    os.environ[BUILD_ENV] = str(folder / "build")  # kept when a test points MTP_VIZ_CACHE elsewhere


def seed_from(user_cache: Path, user_build: Path, folder: Path) -> None:
    """Copy into `folder` what in `user_cache` depends only on a GGUF file the registry ships: its
    conversion into a model directory (mtp_viz.loading.sources.convert_gguf: ~25 s to redo,
    marked with the GGUF's name) and its 4-bit codes (mtp_viz.gguf_codes: keyed by the file's name
    and size and the codes' format version); and the code built for this machine (mtp_viz.native's
    kernels, mtp_viz.static's compiled layers: ~30 s each to build, keyed by their sources, torch
    and the machine). Copies, not links: nothing a test writes can reach the user's files."""
    if user_build.is_dir():
        shutil.copytree(user_build, folder / "build")
    for entry in load_registry().models.values():
        shipped = {s.file for s in entry.sources if s.kind == "gguf_wheel"}
        marker = user_cache / entry.id / CONVERTED_FROM
        if shipped and marker.is_file() and json.loads(marker.read_text()).get("gguf") in shipped:
            shutil.copytree(user_cache / entry.id, folder / entry.id)
    for codes in (user_cache / CODES_FOLDER).glob(f"q4-codes-v{CODES_VERSION}-*.safetensors"):
        (folder / CODES_FOLDER).mkdir(exist_ok=True)
        shutil.copy2(codes, folder / CODES_FOLDER / codes.name)


# The files that take minutes on the 2-core machine, longest first (`pytest --durations`): started
# first, so that on the suite's two workers (a file at a time each: --dist loadfile) none of them is
# left to start when the rest is done. pyproject.toml turns xdist's own order (most tests first) off;
# the other files keep it.
LONGEST_FIRST = (
    "test_vllm_server.py",
    "test_distribution.py",
    "test_weights_embedded.py",
    "test_embedded.py",
    "test_vllm_eagle3.py",
    "test_lean.py",
    "test_browser.py",
    "test_shipped_drafters.py",
    "test_weights_embedded_more.py",
)


def run_order(items) -> None:
    """LONGEST_FIRST's files first, in its order, then the others, those with more tests first; a
    file's tests keep their order."""
    tests = Counter(item.path.name for item in items)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -tests[item.path.name], item.path.name))


def pytest_collection_modifyitems(config, items):
    run_order(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


FAKE_VLLM = Path(__file__).with_name("fake_vllm.py")
POLL_S = 0.05  # how often a test waiting on a condition asks again


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """MTP_VIZ_VLLM_PYTHON → a wrapper that runs the stand-in; returns the pid file it writes."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {FAKE_VLLM} "$@"\n')  # drop "-m vllm..."
    wrapper.chmod(0o755)
    pids = tmp_path / "pids.json"
    monkeypatch.setenv(PYTHON_ENV, str(wrapper))
    monkeypatch.setenv("FAKE_VLLM_PIDS", str(pids))
    return pids


def running(process: int | psutil.Process) -> bool:
    """Whether a process (a pid, or a psutil.Process: then that very process, not a later one given
    its pid) still runs: one that has exited (a zombie not yet reaped too), or that vanishes while
    it is being asked about, does not."""
    try:
        process = process if isinstance(process, psutil.Process) else psutil.Process(process)
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def gone(processes: list[int] | list[psutil.Process], timeout: float = 10.0) -> bool:
    """Whether these processes have all stopped running within `timeout`."""
    return until(lambda: not any(running(p) for p in processes), timeout)


def until(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Whether `condition()` comes true within `timeout` (asked at once, then every POLL_S)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True
