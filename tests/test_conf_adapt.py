"""ConfAdapt: the emission rule on hand-made confidences, the mask-token input layout, and the
edge cases that make it equal autoregressive decoding (τ = 1, k = 1)."""

import pytest
from conftest import OracleHeads, decode, tiny_model

from mtp_viz.cache import CachedModel
from mtp_viz.errors import InvalidSettingsError
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.strategies.conf_adapt import ConfAdaptSettings, emit_count, mask_ids
from mtp_viz.trace import AUTOREGRESSIVE, UNVERIFIED

PROMPT = [5, 17, 3, 42, 9, 17, 3]
MASK = 90


def test_emit_count_is_the_confident_prefix_with_at_least_one():
    assert emit_count([0.95, 0.91, 0.5, 0.99], 0.9) == 2
    assert emit_count([0.2, 0.99, 0.99], 0.9) == 1  # the first token always goes
    assert emit_count([0.9, 0.9], 0.9) == 2  # ≥ τ
    assert emit_count([0.1, 0.1, 0.1], 0.9, fixed=True) == 3
    assert emit_count([1.0], 1.0) == 1


def test_mask_layouts():
    assert mask_ids(MASK, 3, "repeat") == [MASK] * 3
    assert mask_ids(MASK, 3, "offset") == [MASK, MASK + 1, MASK + 2]


def test_settings_are_checked():
    for bad in (dict(k=0), dict(k=17), dict(tau=1.5), dict(mode="all"), dict(predictor="oracle")):
        with pytest.raises(InvalidSettingsError):
            ConfAdaptSettings(**bad)


class Recorder:
    """Wraps CachedModel.forward to record what each call fed: the unseen ids and the cache length."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = CachedModel.forward

        def forward(cached, seq, *args, **kwargs):
            self.calls.append((list(seq[cached.length :]), cached.length))
            return real(cached, seq, *args, **kwargs)

        monkeypatch.setattr(CachedModel, "forward", forward)


@pytest.mark.parametrize("layout", ["repeat", "offset"])
def test_mask_token_input_layout_and_cache(layout, monkeypatch):
    model = tiny_model("llama-2l", seed=0)
    rec = Recorder(monkeypatch)
    out, steps = decode(
        model,
        "conf_adapt",
        PROMPT,
        GenerationSettings(max_new_tokens=12),
        mask_token_id=MASK,
        k=3,
        tau=0.0,
        predictor="mask_tokens",
        mask_layout=layout,
    )
    masks = mask_ids(MASK, 2, layout)
    assert rec.calls[0] == (PROMPT + masks, 0)
    emitted_before = 0
    for (ids, cached), step in zip(rec.calls[1:], steps[1:], strict=False):
        emitted_before += len(steps[step.index - 1].emitted)
        # last step's tokens, then k−1 masks, against a cache of everything before them
        assert ids[: -len(masks)] == out[emitted_before - len(steps[step.index - 1].emitted) : emitted_before]
        assert ids[-len(masks) :] == masks
        assert cached == len(PROMPT) + emitted_before - len(steps[step.index - 1].emitted)
    assert [len(s.emitted) for s in steps[:-1]] == [3] * (len(steps) - 1)  # τ = 0: all k
    assert all(s.kv_len == len(PROMPT) + sum(len(x.emitted) for x in steps[: s.index]) for s in steps)
    assert [e.origin for e in steps[0].emitted] == [AUTOREGRESSIVE, UNVERIFIED, UNVERIFIED]


@pytest.mark.parametrize("predictor", ["mask_tokens", "heads"])
def test_tau_one_and_k_one_reduce_to_autoregressive(predictor):
    model = tiny_model("qwen2-2l", seed=1)
    generation = GenerationSettings(max_new_tokens=30)
    reference, _ = decode(model, "autoregressive", PROMPT, generation)
    heads = OracleHeads(model, PROMPT, reference, confidence=2.0)
    for settings in (dict(k=4, tau=1.0), dict(k=1, tau=0.0)):
        out, steps = decode(
            model, "conf_adapt", PROMPT, generation, heads=heads, mask_token_id=MASK, predictor=predictor, **settings
        )
        assert out == reference
        assert all(len(s.emitted) == 1 for s in steps)


def test_heads_predictor_emits_confident_guesses_and_respects_eos_and_budget():
    model = tiny_model("llama-2l", seed=0)
    generation = GenerationSettings(max_new_tokens=40)
    reference, _ = decode(model, "autoregressive", PROMPT, generation)
    heads = OracleHeads(model, PROMPT, reference, wrong_every=1000, confidence=30.0)  # always right, sure
    # The random target is never confident itself, so τ sits below its first-token confidences.
    tau = 0.005
    out, steps = decode(model, "conf_adapt", PROMPT, generation, heads=heads, k=4, tau=tau, predictor="heads")
    assert out == reference  # right guesses emitted unverified give the same text, faster
    assert len(steps) < len(reference) / 2
    assert all(e.confidence > 0.6 for s in steps for e in s.emitted if e.origin == UNVERIFIED)
    eos = reference[9]
    out, _ = decode(model, "conf_adapt", PROMPT, generation, heads=heads, eos=[eos], k=4, tau=tau, predictor="heads")
    assert out == reference[: reference.index(eos) + 1]
    for budget in (1, 5, 6):
        out, _ = decode(
            model, "conf_adapt", PROMPT, GenerationSettings(max_new_tokens=budget), heads=heads, k=4, tau=tau
        )
        assert out == reference[:budget]


def test_unconfident_heads_fall_back_to_one_token_per_forward():
    model = tiny_model("llama-2l", seed=0)
    reference, _ = decode(model, "autoregressive", PROMPT, GenerationSettings(max_new_tokens=20))
    heads = OracleHeads(model, PROMPT, reference, confidence=0.1)  # near-uniform guesses
    _, steps = decode(model, "conf_adapt", PROMPT, GenerationSettings(max_new_tokens=20), heads=heads, k=4, tau=0.9)
    assert all(len(s.emitted) == 1 for s in steps)
    _, fixed = decode(
        model, "conf_adapt", PROMPT, GenerationSettings(max_new_tokens=20), heads=heads, k=4, mode="fixed"
    )
    assert all(len(s.emitted) == 4 for s in fixed)
