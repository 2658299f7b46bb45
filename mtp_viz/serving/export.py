"""Our models as plain model directories another engine loads: the target's converted copy as it
is, a trained draft (`mtp_viz.drafters.draft`) rebuilt as an ordinary causal LM, and an EAGLE-3
drafter rewritten in vLLM's format (ours is in it already; a published one gains explicit layer
ids and a safetensors file).

The trained draft shares the target's embedding and scores a reduced vocabulary with the
target's head rows. A plain checkpoint has neither: the export copies the embedding and gives the
draft the target's full head (tied to the embedding, as the target's is). The rows outside the
reduced vocabulary were never part of the draft's training, so the exported draft can propose a
token the trained one never would; the target's verification keeps output identical either way.
"""

import json
from pathlib import Path

import torch

from mtp_viz.drafters.eagle3 import CONFIG_FILE, load_eagle3, save_eagle3
from mtp_viz.errors import UserError
from mtp_viz.loading import DTYPES, LoadedModel, eagle3_dir, is_model_dir, load_model
from mtp_viz.loading.sources import save_atomically
from mtp_viz.paths import cache_root
from mtp_viz.registry import Eagle3Entry, load_registry

STAMP = "mtp_viz_export.json"


def model_dir(loaded: LoadedModel) -> str:
    """Where a loaded target's weights lie as a model directory (or its hub id)."""
    kind, _, where = loaded.source.partition(":")
    if kind == "hub" or (where and is_model_dir(where)):
        return where
    raise UserError(f"model {loaded.name} is not a plain model directory ({loaded.source}); vLLM cannot load it")


def export_draft(draft_name: str, out: Path | None = None) -> Path:
    """A registered trained draft (or a plain draft directory) as a directory vLLM loads."""
    entry = load_registry().models.get(draft_name)
    if entry is None or not any(s.kind == "trained_draft" for s in entry.sources):
        if is_model_dir(draft_name):
            return Path(draft_name)
        if entry is not None:
            return Path(model_dir(load_model(draft_name, "cpu", "float32")))
        raise UserError(f"{draft_name} is neither a registered draft nor a model directory")
    source = next(s for s in entry.sources if s.kind == "trained_draft")
    out = out or cache_root() / "export" / draft_name
    weights = Path(source.path) / "weights.safetensors"
    stamp = {"draft": draft_name, "weights_mtime_ns": weights.stat().st_mtime_ns}
    if is_model_dir(str(out)) and (out / STAMP).is_file() and json.loads((out / STAMP).read_text()) == stamp:
        return out
    draft = load_model(draft_name, "cpu", "float32")
    base = load_model(source.base, "cpu", "float32")
    plain = _plain_draft(draft.model, base.model)

    def write(folder: Path) -> None:
        plain.save_pretrained(folder)
        base.tokenizer.save_pretrained(folder)
        (folder / STAMP).write_text(json.dumps(stamp))

    return save_atomically(out, write)


def export_eagle3(name: str, out: Path) -> Path:
    """A registered EAGLE-3 drafter (or a checkpoint directory) written to `out` as vLLM's
    LlamaForCausalLMEagle3 loads it, read back through our loader first so a broken one stops here."""
    registry = load_registry()
    if name in registry.eagle3:
        entry = registry.get_eagle3(name)
    elif Path(name, CONFIG_FILE).is_file():
        entry = Eagle3Entry(name, name, "", path=name)
    else:
        registry.get_eagle3(name)  # raises with the list of known drafters
        raise AssertionError("unreachable")
    source = eagle3_dir(entry)
    if Path(out).resolve() == source.resolve():
        raise UserError(f"{out} is the drafter's own directory; choose another folder")
    config = json.loads((source / CONFIG_FILE).read_text(encoding="utf-8"))
    eagle = config.get("eagle_config") or {}
    named = config.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    layers = None  # a published drafter may name no layers: the base's depth gives vLLM's default
    if not named and entry.base:
        layers = load_model(entry.base, "cpu", "float32").model.config.num_hidden_layers
    dtype = DTYPES.get(str(config.get("torch_dtype") or config.get("dtype")), torch.float32)
    drafter = load_eagle3(source, target_layers=layers, dtype=dtype)
    return save_atomically(Path(out), lambda folder: save_eagle3(drafter, folder))


@torch.no_grad()
def _plain_draft(draft, target):
    """The draft's layers and norm with the target's embedding and full, tied head."""
    config = draft.config.__class__.from_dict(draft.config.to_dict())
    config.tie_word_embeddings = True
    plain = type(target)(config).eval()
    state = {k: v for k, v in draft.state_dict().items() if not k.startswith("lm_head.")}
    state["model.embed_tokens.weight"] = target.model.embed_tokens.weight
    missing, unexpected = plain.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise AssertionError(f"draft export: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()
    plain.generation_config = target.generation_config
    return plain
