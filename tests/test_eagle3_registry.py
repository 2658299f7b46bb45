"""EAGLE-3 drafters in the registry (models.yaml `eagle3:`) and `load_eagle3_for`, on a tiny
random Llama target and tiny checkpoints written by `save_eagle3`. Nothing here downloads."""

import json

import pytest
import torch
from conftest import save_tiny_dir
from safetensors.torch import load_file

from mtp_viz import loading
from mtp_viz.drafters.eagle3 import Eagle3Config, Eagle3Drafter, save_eagle3
from mtp_viz.errors import UnknownModelError, UserError
from mtp_viz.loading import eagle3 as eagle3_models
from mtp_viz.loading import load_eagle3_for, load_model
from mtp_viz.registry import DEFAULT_REGISTRY, _load, parse_registry

TARGET_LAYERS = 2  # conftest's llama-2l: hidden 32, 4 heads, 2 kv heads


def registry_data(**extra) -> dict:
    return {
        "defaults": {"cpu": "t"},
        "models": [
            {"id": "t", "sources": [{"kind": "local", "path": "target"}], "eagle3": ["t-eagle3", "t-missing"]},
            {"id": "u", "sources": [{"kind": "local", "path": "target"}]},
        ],
        "eagle3": [
            {"id": "t-eagle3", "label": "tiny EAGLE-3", "base": "t", "path": "eagle3/t"},
            {"id": "t-missing", "base": "t", "path": "eagle3/not-trained-yet"},
            {"id": "t-hub", "base": "t", "repo": "someone/EAGLE3-tiny"},
            {"id": "t-wide", "base": "t", "path": "eagle3/wide"},
        ],
    } | extra


def tiny_drafter(vocab: int, hidden: int = 32, draft_vocab: int = 8, seed: int = 0) -> Eagle3Drafter:
    config = Eagle3Config(
        hidden_size=hidden,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        aux_layer_ids=(0, 1, TARGET_LAYERS),  # vLLM's default (2, L//2, L-3) needs a deeper target
    )
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(config)
    targets = torch.arange(draft_vocab) * 2
    drafter.d2t.copy_(targets - torch.arange(draft_vocab))
    drafter.t2d.zero_()[targets] = True
    return drafter


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3-registry")
    save_tiny_dir(root / "target")
    vocab = json.loads((root / "target" / "config.json").read_text())["vocab_size"]
    save_eagle3(tiny_drafter(vocab), root / "eagle3" / "t")
    save_eagle3(tiny_drafter(vocab, hidden=48), root / "eagle3" / "wide")
    (root / "models.yaml").write_text(json.dumps(registry_data()))
    return root


@pytest.fixture
def target(tiny_root, monkeypatch):
    """Model "t" of this file's registry. The loader caches by name and other files' registries name
    a model "t" too (test_mask_mtp), so the cache is emptied before and after, whatever ran first."""
    monkeypatch.setenv("MTP_VIZ_MODELS", str(tiny_root / "models.yaml"))
    loading.forget()
    yield load_model("t", "cpu", "float32")
    loading.forget()


def test_the_registry_reads_eagle3_entries_and_resolves_paths(tiny_root):
    registry = _load(str(tiny_root / "models.yaml"))
    assert registry.models["t"].eagle3 == ("t-eagle3", "t-missing")
    assert registry.models["u"].eagle3 == ()
    entry = registry.get_eagle3("t-eagle3")
    assert (entry.label, entry.base, entry.repo) == ("tiny EAGLE-3", "t", None)
    assert entry.path == str((tiny_root / "eagle3" / "t").resolve())
    hub = registry.get_eagle3("t-hub")
    assert (hub.path, hub.repo, hub.label) == (None, "someone/EAGLE3-tiny", "t-hub")
    with pytest.raises(UnknownModelError, match="unknown EAGLE-3 drafter 'nope'.*t-eagle3"):
        registry.get_eagle3("nope")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"eagle3": [{"id": "x", "base": "nobody", "path": "p"}]}, "eagle3 x: base 'nobody' is not in the registry"),
        ({"eagle3": [{"id": "x", "base": "t"}]}, "eagle3 x: neither a path nor a repo"),
        ({"eagle3": [{"id": "x", "base": "t", "path": "p", "repo": "a/b"}]}, "eagle3 x: both a path and a repo"),
        ({"eagle3": [{"base": "t", "path": "p"}]}, "needs an id and a base"),
        ({"eagle3": []}, "model t: EAGLE-3 drafter 't-eagle3' is not in the registry's eagle3 list"),
    ],
)
def test_a_bad_eagle3_entry_is_a_clear_error(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        parse_registry(registry_data(**change), tmp_path)


def test_a_model_cannot_list_another_models_drafter(tmp_path):
    data = registry_data()
    data["models"][1]["eagle3"] = ["t-eagle3"]
    with pytest.raises(ValueError, match="model u: EAGLE-3 drafter 't-eagle3' is registered for t"):
        parse_registry(data, tmp_path)


def test_the_shipped_registry_names_the_embedded_drafter_without_needing_it():
    """The embedded model's drafter may not be trained yet: the registry loads all the same."""
    registry = _load(str(DEFAULT_REGISTRY))
    first = registry.get_eagle3(registry.models["smollm2-135m"].eagle3[0])
    assert first.id == "smollm2-135m-eagle3" and first.path.endswith("assets/eagle3/smollm2-135m-eagle3")
    for entry in registry.eagle3.values():
        assert entry.base in registry.models and bool(entry.path) != bool(entry.repo)


def test_the_first_registered_drafter_loads_on_the_targets_device_sharing_its_embedding(target):
    name, drafter = load_eagle3_for(target)
    assert name == "t-eagle3"
    assert drafter.embed_tokens is target.model.get_input_embeddings()
    assert drafter.fc.weight.dtype == torch.float32 and drafter.fc.weight.device == target.device
    assert drafter.config.aux_layer_ids == (0, 1, TARGET_LAYERS)
    assert load_eagle3_for(target, "t-eagle3")[1] is drafter  # cached per (target, drafter)
    with torch.no_grad():
        out = target.model(torch.tensor([[4, 5, 6]]), output_hidden_states=True)
        features = torch.cat([out.hidden_states[i][0] for i in drafter.config.aux_layer_ids], dim=-1)  # (3, 3H)
        logits, hidden = drafter(drafter.fuse(features), torch.tensor([5, 6, 7]), torch.arange(3), drafter.new_cache(8))
    assert logits.shape == (3, 8) and hidden.shape == (3, 32) and torch.isfinite(logits).all()


def test_a_checkpoint_directory_loads_by_its_path(target, tiny_root):
    name, drafter = load_eagle3_for(target, str(tiny_root / "eagle3" / "t"))
    assert name == str(tiny_root / "eagle3" / "t") and drafter.config.draft_vocab_size == 8


def test_a_registered_drafter_not_trained_yet_says_how_to_train_it(target):
    with pytest.raises(UserError, match="t-missing is registered at .*not-trained-yet.*train eagle"):
        load_eagle3_for(target, "t-missing")


def test_no_registered_drafter_says_how_to_train_one(tiny_root, monkeypatch):
    monkeypatch.setenv("MTP_VIZ_MODELS", str(tiny_root / "models.yaml"))
    with pytest.raises(UserError, match="no EAGLE-3 drafter registered for u; train one with python -m mtp_viz"):
        load_eagle3_for(load_model("u", "cpu", "float32"))


def test_a_drafter_of_another_base_or_unknown_id_is_refused(target, tiny_root, monkeypatch):
    with pytest.raises(UnknownModelError, match="unknown EAGLE-3 drafter 'nope'"):
        load_eagle3_for(target, "nope")
    other = load_model("u", "cpu", "float32")
    with pytest.raises(UserError, match="t-eagle3 was trained for t, not u"):
        load_eagle3_for(other, "t-eagle3")


def test_a_hub_drafter_without_the_hub_is_a_clear_error(target, monkeypatch):
    monkeypatch.setattr(eagle3_models, "hub_reachable", lambda: False)
    with pytest.raises(UserError, match="t-hub lives on the Hugging Face Hub \\(someone/EAGLE3-tiny\\), not reachable"):
        load_eagle3_for(target, "t-hub")


def test_a_drafter_of_other_sizes_says_which_do_not_fit(target):
    with pytest.raises(UserError, match="t-wide does not fit t: target hidden size 48 \\(the target's: 32\\)"):
        load_eagle3_for(target, "t-wide")


def test_a_hub_drafter_is_downloaded_once_reachable(target, tiny_root, monkeypatch):
    import huggingface_hub

    asked = []

    def fake_download(repo, allow_patterns):  # the checkpoint "on the hub" is the tiny one
        asked.append((repo, tuple(allow_patterns)))
        return str(tiny_root / "eagle3" / "t")

    monkeypatch.setattr(eagle3_models, "hub_reachable", lambda: True)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    name, drafter = load_eagle3_for(target, "t-hub")
    assert name == "t-hub" and drafter.config.draft_vocab_size == 8
    assert asked == [("someone/EAGLE3-tiny", eagle3_models.EAGLE3_FILES)]


def test_the_published_llama_drafter_is_registered_for_its_target():
    registry = _load(str(DEFAULT_REGISTRY))
    target = registry.models["llama3.1-8b"]
    assert target.eagle3 == ("llama3.1-8b-eagle3",)
    assert [s.repo for s in target.sources] == ["meta-llama/Llama-3.1-8B-Instruct"]
    assert registry.get_eagle3("llama3.1-8b-eagle3").repo == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"


def test_export_writes_a_registered_drafter_that_loads_back_the_same(target, tiny_root, tmp_path):
    from mtp_viz.serving.export import export_eagle3

    out = export_eagle3("t-eagle3", tmp_path / "exported")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    _, mine = load_eagle3_for(target, "t-eagle3")
    _, back = load_eagle3_for(target, str(out))
    assert back.config == mine.config
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), mine.state_dict().values(), strict=True))
    with pytest.raises(UserError, match="the drafter's own directory"):
        export_eagle3("t-eagle3", tiny_root / "eagle3" / "t")


def test_export_names_the_layers_a_published_drafter_leaves_to_the_default(tmp_path, monkeypatch):
    """A published checkpoint (pytorch_model.bin, no layer ids) comes out as safetensors with the ids
    vLLM would have chosen for its base, (2, L//2, L-3), written down."""
    from mtp_viz.serving.export import export_eagle3

    save_tiny_dir(tmp_path / "deep", "llama-3l-mha")  # hidden 48, 3 layers: default ids (2, 1, 0)
    vocab = json.loads((tmp_path / "deep" / "config.json").read_text())["vocab_size"]
    published = tmp_path / "published"
    save_eagle3(tiny_drafter(vocab, hidden=48), published)
    config = json.loads((published / "config.json").read_text())
    del config["eagle_config"]
    (published / "config.json").write_text(json.dumps(config))
    torch.save(load_file(published / "model.safetensors"), published / "pytorch_model.bin")
    (published / "model.safetensors").unlink()
    registry = {
        "defaults": {"cpu": "d"},
        "models": [{"id": "d", "sources": [{"kind": "local", "path": "deep"}], "eagle3": ["d-pub"]}],
        "eagle3": [{"id": "d-pub", "base": "d", "path": "published"}],
    }
    (tmp_path / "models.yaml").write_text(json.dumps(registry))
    monkeypatch.setenv("MTP_VIZ_MODELS", str(tmp_path / "models.yaml"))
    out = export_eagle3("d-pub", tmp_path / "out")
    written = json.loads((out / "config.json").read_text())
    assert written["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 1, 0]
    assert (out / "model.safetensors").is_file() and not (out / "pytorch_model.bin").exists()


def test_the_vllm_plan_serves_the_registered_checkpoint_directory(target, tiny_root):
    from mtp_viz.runner import RunRequest
    from mtp_viz.serving.backend import plan
    from mtp_viz.serving.methods import EAGLE_CHAIN_NOTE

    p = plan(RunRequest(prompt="hi", model="t", strategy="eagle", strategy_settings={"depth": 3}, device="cpu"))
    directory = str((tiny_root / "eagle3" / "t").resolve())
    assert p.speculative_config == {"method": "eagle3", "model": directory, "num_speculative_tokens": 3}
    assert p.draft_name == "t-eagle3" and p.settings.draft_tree == "chain" and p.note == EAGLE_CHAIN_NOTE
    assert "--speculative-config" in p.server.extra_args
    with pytest.raises(UserError, match="t-missing is registered at .*train eagle"):
        plan(RunRequest(prompt="hi", model="t", strategy="eagle", eagle3="t-missing", device="cpu"))
