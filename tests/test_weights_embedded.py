"""The embedded model in its shipped 4-bit codes: how exact the mapping onto torch's int4 kernel
is, and every lossless strategy token-identical to autoregressive decoding on the same weights,
in every format."""

import copy
from dataclasses import replace

import pytest
import torch

from mtp_viz import native
from mtp_viz.loading import load_model
from mtp_viz.quality import first_divergence
from mtp_viz.runner import RunRequest, run
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.weights import BF16, GROUP, Q4, Q8, FormatLinear, Q4Linear, Q8Linear, head_format

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
PROMPT = "Fix the bug in this function and return the whole function:\ndef mean(xs):\n    return sum(xs) / len(x)\n"
MAX_NEW = 40


@pytest.fixture(scope="module")
def fp32():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def q4():
    return load_model(MODEL, weights=Q4)


def q4_layers(model) -> dict[str, Q4Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Q4Linear)}


def test_every_layer_keeps_the_files_codes_and_the_head_is_q8_beside_our_kernels(q4):
    layers = q4_layers(q4.model)
    assert len(layers) == 210  # 30 layers × q, k, v, o, gate, up, down: the GGUF's Q4_1 matrices
    head = q4.model.lm_head
    if native.available():  # the GGUF's own Q8_0 head codes, float32 logits (weights.head_format)
        assert isinstance(head, Q8Linear)
    else:
        assert not isinstance(head, FormatLinear)
    assert head_format(Q4) == (Q8 if native.available() else "fp32")
    assert "GGUF Q4_1 codes" in q4.weights_detail


def test_the_files_codes_are_the_converted_weights_exactly(fp32, q4):
    """w = q·d + m from the file's codes equals, bit for bit, the float32 weights transformers
    dequantized (q_proj and k_proj rows in transformers' order): largest difference 0.0."""
    reference = dict(fp32.model.named_modules())
    worst = max(
        (m.q4_codes().dequantize() - reference[n].weight).abs().max().item() for n, m in q4_layers(q4.model).items()
    )
    assert worst == 0.0


def test_the_kernels_weights_against_the_converted_ones(fp32, q4):
    """Our kernel (mtp_viz.native) multiplies the file's q·d + m: exactly the converted weights.
    torch's int4 kernel, where ours cannot run, computes (q − 8)·scale + zero with bfloat16 scale and
    zero: its largest weight difference is measured here (docs/BENCHMARKS.md quotes it)."""
    reference = dict(fp32.model.named_modules())
    layers = q4_layers(q4.model)
    if native.available():
        ours = max((m.dequantize() - reference[n].weight).abs().max().item() for n, m in layers.items())
        assert ours == 0.0
        name = "model.layers.3.self_attn.q_proj"  # through our kernel itself: an identity input
        eye = torch.eye(layers[name].in_features)
        assert (layers[name].product(eye).T - reference[name].weight).abs().max().item() == 0.0
    name = "model.layers.3.self_attn.q_proj"
    layer = copy.deepcopy(layers[name]).on_torch_kernel()
    fast = (layer.dequantize() - reference[name].weight).abs().max().item()
    assert 0 < fast < 0.03
    packed, _ = layer.kernel()  # through torch's kernel itself, float32 path: an identity input
    eye = torch.eye(layer.in_features)
    exact = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, GROUP, layer.kernel_scales(torch.float32))
    assert (exact.T - reference[name].weight).abs().max().item() == 0.0
    fast_kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(
        eye.to(torch.bfloat16), packed, GROUP, layer.kernel_scales()
    )
    assert torch.equal(fast_kernel.T.float(), layer.dequantize().to(torch.bfloat16).float())


@pytest.mark.parametrize("weights", [Q4, BF16])
def test_lossless_strategies_identical_to_autoregressive_on_the_same_weights(weights):
    """Token-identical, every one: a verify's rows attend one at a time (kv_slots.RowKeys) and each
    format's products run under the row plan measured on this machine (mtp_viz.row_plan), so each
    row computes what the one-token forward computes. (Attending in one batched call made them part
    from AR at near-ties: bfloat16 products turn the batched attention's ~1e-7 difference into up
    to ~0.3 logits; on an Intel Xeon with AMX, bf16's unplanned products parted lookahead at token
    17.) int8 and fp32: tests/test_weights_embedded_more.py (another file, so another worker)."""
    assert_identical_to_autoregressive(weights)


def assert_identical_to_autoregressive(weights: str) -> None:
    """Every lossless strategy's tokens equal AR's on the embedded model in `weights`; a format
    not lossless on this machine fails first, named by the trace's machine line."""
    generation = GenerationSettings(max_new_tokens=MAX_NEW)
    reference = run(RunRequest(prompt=PROMPT, model=MODEL, generation=generation, weights=weights))
    assert reference.machine["weights"].startswith(weights)
    assert "not lossless" not in reference.machine["linear"], reference.machine["linear"]
    for strategy, draft, kw in STRATEGIES:
        request = RunRequest(prompt=PROMPT, model=MODEL, strategy=strategy, draft=draft, generation=generation)
        trace = run(replace(request, strategy_settings=kw, weights=weights))
        assert trace.machine["weights"] == reference.machine["weights"], strategy
        at = first_divergence(reference.output_token_ids, trace.output_token_ids)
        assert at is None, f"{strategy} parted from autoregressive decoding at token {at} in {weights}"


STRATEGIES = (
    ("prompt_lookup", None, {}),
    ("speculative", "smollm2-135m-draft", {"num_draft_tokens": 3}),  # the trained draft, in the same format
    ("speculative", "smollm2-135m-exit20", {"num_draft_tokens": 2}),
    ("lookahead", None, {}),
    ("self_speculative", None, {"exit_layer": 12}),
    ("mtp_heads", None, {}),  # the shipped heads, in the same format
    ("mask_spec", None, {}),  # the mask-token model: LoRA (float32) on the format's base
)
