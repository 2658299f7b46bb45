"""The stand-in a lent GPU times when the embedded model's weights cannot travel: the model's own
small files carried (never its weights), random weights of its shapes built there, found as the
registered model's converted copy."""

import json

import torch
from conftest import save_tiny_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

from mtp_viz.loading import standin
from mtp_viz.loading.sources import CONVERTED_FROM, _locate
from mtp_viz.paths import CACHE_ENV
from mtp_viz.registry import load_registry


def test_a_standin_has_the_models_shapes_and_tokenizer_but_not_its_weights(tmp_path, monkeypatch):
    original = save_tiny_dir(tmp_path / "cache" / standin.MODEL, seed=7)  # "trained": not the stand-in's seed
    (original / CONVERTED_FROM).write_text("{}")
    carried = standin.carry(original, tmp_path / "carry")
    assert not [p for p in carried.iterdir() if p.name.endswith(standin.WEIGHTS) or p.name == CONVERTED_FROM]
    assert sum(p.stat().st_size for p in carried.iterdir()) < sum(p.stat().st_size for p in original.iterdir())
    built = standin.build(carried, tmp_path / "device-cache")
    assert json.loads((built / standin.MARKER).read_text())["random_weights"] is True
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "device-cache"))
    entry = load_registry().models[standin.MODEL]
    cache_source = next(s for s in entry.sources if s.kind == "cache")
    assert _locate(entry, cache_source) == (str(built), "")  # what loading the embedded model finds there
    a = AutoModelForCausalLM.from_pretrained(original)
    b = AutoModelForCausalLM.from_pretrained(built)
    shapes = lambda m: {n: p.shape for n, p in m.state_dict().items()}  # noqa: E731
    assert shapes(a) == shapes(b)
    assert not torch.equal(a.model.layers[0].mlp.up_proj.weight, b.model.layers[0].mlp.up_proj.weight)
    text = "a stand-in of the same shapes"
    encode = lambda where: AutoTokenizer.from_pretrained(where)(text).input_ids  # noqa: E731
    assert encode(original) == encode(built)
