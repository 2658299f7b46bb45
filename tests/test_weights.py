"""Weight formats (mtp_viz.weights): what each holds, that the fused and the single products agree,
and that every lossless strategy stays token-identical to autoregressive decoding on the same
weights, in every format, on tiny random models, through both engines."""

import copy

import pytest
import torch
from conftest import decode, perturbed, tiny_model
from test_greedy_identity import PROMPT, _lossless_runs

from mtp_viz import kernel_plan, native, row_plan
from mtp_viz.cache import ENGINE_ENV, ENGINES, LEAN, CachedModel
from mtp_viz.errors import UserError
from mtp_viz.kernels import FIXED_PLAN, use_fast_linears
from mtp_viz.lean import lean_model
from mtp_viz.machine import describe
from mtp_viz.row_plan import PROBED_ROWS
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.trace import VERDICT_ACCEPTED, VERDICT_REJECTED
from mtp_viz.visibility import tree_visibility
from mtp_viz.weights import (
    BF16,
    FORMATS,
    FP32,
    GROUP,
    INT8,
    Q4,
    FormatLinear,
    Q4Linear,
    apply_format,
    check_format,
    convert,
    format_of,
    fuse,
    head_format,
    kernel_pack,
    quantize_q4,
)

QUANTIZED = [f for f in FORMATS if f != FP32]


def formatted(fmt: str, name: str = "llama-2l", seed: int = 0):
    return apply_format(tiny_model(name, seed=seed), fmt)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_every_linear_is_swapped_and_the_head_takes_its_own_format(fmt):
    model = formatted(fmt)
    linears = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, FormatLinear) for m in linears)
    assert getattr(model.lm_head, "fmt", FP32) == head_format(fmt)
    assert {m.fmt for m in model.model.layers.modules() if isinstance(m, FormatLinear)} == {fmt}
    assert format_of(model) == fmt and format_of(tiny_model()) == FP32
    other = tiny_model()  # a model sharing the formatted layers (an early exit) is in the format: its types say so
    other.model.layers = model.model.layers
    assert format_of(other) == fmt and "mtp_viz_weights" not in vars(model)
    assert apply_format(other, fmt).model.layers[0].mlp.down_proj is model.model.layers[0].mlp.down_proj


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_a_format_stays_close_to_fp32(fmt):
    """Each product is the fp32 one up to the format's rounding (bf16 ≪ int8 < 4 bits)."""
    torch.manual_seed(0)
    w = torch.randn(96, 128) * 0.05
    linear = torch.nn.Linear(128, 96, bias=False)
    linear.weight.data = w
    made = apply_format(torch.nn.Sequential(linear), fmt)[0]
    x = torch.randn(5, 128)
    relative = ((made(x) - x @ w.T).norm() / (x @ w.T).norm()).item()
    assert relative < {BF16: 0.01, INT8: 0.02, Q4: 0.15}[fmt]
    assert made(x).dtype == torch.float32
    assert (made.weight - w).abs().max() <= {BF16: 0.002, INT8: 0.002, Q4: 0.03}[fmt]


def test_q4_codes_follow_the_q4_1_rule():
    torch.manual_seed(1)
    w = torch.randn(8, 4 * GROUP)
    codes = quantize_q4(w)
    assert codes.codes.max() <= 15 and codes.codes.dtype == torch.uint8
    blocks = w.view(8, 4, GROUP)
    assert torch.equal(codes.m, blocks.amin(-1).half())
    # a block's error is at most half a step, plus the float16 roundings of d and m
    step = codes.d.float().repeat_interleave(GROUP, dim=1)
    assert ((codes.dequantize() - w).abs() <= step * 0.5 + 2e-3).all()


def test_the_fast_int4_packing_is_torchs():
    """kernel_pack writes torch's int4 CPU layout with tensor ops (torch's packer is ~10 s for the model)."""
    for n, k in ((128, 64), (192, 96), (16, 64)):
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        expected = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
        assert torch.equal(kernel_pack(codes), expected)


@pytest.mark.parametrize("ours", [True, False], ids=["our kernel", "torch's kernel"])
def test_q4_dequantized_weights_are_what_the_kernel_multiplies(ours):
    torch.manual_seed(2)
    layer = Q4Linear.of(torch.randn(64, 2 * GROUP))
    if not ours:
        layer.on_torch_kernel()
    elif not layer.native:
        pytest.skip(f"mtp-viz's CPU kernels are unavailable here: {native.unavailable()}")
    eye = torch.eye(2 * GROUP)
    through_kernel = layer(eye).T  # (N, K): each column of the identity picks one weight
    if ours:  # float32 activations: the file's q·d + m exactly
        assert torch.equal(through_kernel, layer.q4_codes().dequantize())
    else:  # the product is bf16-rounded
        assert torch.equal(through_kernel, layer.weight.bfloat16().float())


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_fused_product_equals_the_separate_ones_and_shares_their_buffers(fmt):
    model = formatted(fmt)
    attn = model.model.layers[0].self_attn
    x = torch.randn(3, 32)
    separate = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
    joined = fuse((attn.q_proj, attn.k_proj, attn.v_proj))
    assert torch.equal(joined(x), separate)
    name = joined.ROWS[0]
    assert getattr(attn.q_proj, name).untyped_storage().data_ptr() == getattr(joined, name).untyped_storage().data_ptr()
    assert joined.current()
    again = fuse((attn.q_proj, attn.k_proj, attn.v_proj))  # already views: no copy
    assert getattr(again, name).data_ptr() == getattr(joined, name).data_ptr()


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_lean_and_transformers_forwards_agree_in_a_format(fmt, monkeypatch):
    model = formatted(fmt, "qwen2-2l")  # q|k|v with biases
    assert lean_model(model) is not None
    lean = CachedModel(model).forward(PROMPT, logits_to_keep=len(PROMPT))
    monkeypatch.setenv(ENGINE_ENV, "transformers")
    reference = CachedModel(model).forward(PROMPT, logits_to_keep=len(PROMPT))
    assert torch.allclose(lean, reference, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("name", ["llama-2l", "qwen2-2l"])
def test_lossless_strategies_identical_to_autoregressive_in_every_format(name, fmt, engine, monkeypatch):
    monkeypatch.setenv(ENGINE_ENV, engine)
    model = tiny_model(name, seed=0)
    draft = apply_format(perturbed(model, noise=0.2, seed=10), fmt)
    apply_format(model, fmt)
    generation = GenerationSettings(max_new_tokens=40)
    reference, _ = decode(model, "autoregressive", PROMPT, generation)
    for label, output, steps in _lossless_runs(model, draft, generation):
        assert output == reference, label
        verdicts = [v for s in steps for v in s.verdicts]
        assert VERDICT_ACCEPTED in verdicts and VERDICT_REJECTED in verdicts, label


# the embedded model's product shapes (out, in): fused q|k|v, o, fused gate|up, down
EMBEDDED_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


HEAD_SHAPE = (49152, 576)  # the embedded model's output head: float32 in every format


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_formats_planned_product_is_row_invariant_on_this_machine(fmt):
    """Row i of an M-row product, as the engine computes it here (the format's kernel under the row
    plan measured on this machine, mtp_viz.row_plan), equals row i computed as the one-token
    forward computes it, bit for bit, for every M a strategy verifies: what lets a verify's rows
    equal autoregressive steps (kv_slots.RowKeys does the same for attention). Fails on the first
    machine where no plan makes a product exact, naming the format, the shape and the row count."""
    torch.manual_seed(0)
    shapes = (*EMBEDDED_SHAPES, HEAD_SHAPE) if fmt == FP32 else EMBEDDED_SHAPES
    # fp32: the engine's float32 linears, FastLinear under a kernel plan (the fixed one mixes both ways)
    made = (lambda m: use_fast_linears(m, FIXED_PLAN)) if fmt == FP32 else (lambda m: convert(m, fmt))
    linears = [made(torch.nn.Linear(inp, out, bias=False)) for out, inp in shapes]
    found = [row_plan.products(m)[fmt][0] for m in linears]
    record = row_plan.measure(fmt, found)
    assert record["plan"]["exact"], f"{fmt} is not lossless on this machine: {record['plan']['why']}"
    plan = row_plan.plan_of_record(record)
    with torch.inference_mode():
        for (out, inp), linear in zip(shapes, linears, strict=True):
            linear.row_plan = plan
            x = torch.randn(max(PROBED_ROWS), inp)  # other inputs than the probe's
            alone = torch.cat([linear(x[i : i + 1]) for i in range(len(x))])
            for m in PROBED_ROWS:
                assert torch.equal(linear(x[:m]), alone[:m]), f"{fmt} {out}x{inp}: {m} rows under {plan.describe()}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_verify_rows_are_one_token_forwards_bit_for_bit(fmt, tmp_path, monkeypatch):
    """A chain and a tree scored in one forward after the prompt: every row's hidden state equals
    the one-token forward's along its path, bit for bit. At this size (the embedded model's widths,
    two layers) a batched attention call's rows differ from one-token calls (by up to 0.012 in the
    bf16 model's hidden states on a 2-core EPYC); the target attends one row at a time after the
    prompt's prefill (CachedModel's prompt_length), and each format's products run under the row
    plan measured on this machine (mtp_viz.row_plan), as a loaded model's do."""
    monkeypatch.setenv("MTP_VIZ_CACHE", str(tmp_path))
    model = apply_format(
        tiny_model("llama-2l", hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1152),
        fmt,
    )
    row_plan.apply(model, kernel_plan.row_plans(use_fast_linears(model, FIXED_PLAN)))
    prompt = torch.randint(0, 96, (120,), generator=torch.Generator().manual_seed(0)).tolist()

    def stepped(path: list[int]) -> torch.Tensor:  # the prompt's last token, then one token at a time
        cached = CachedModel(model, prompt_length=len(prompt))
        rows = [cached.forward_hidden(prompt)[1][-1]]
        rows += [cached.forward_hidden(prompt + path[: i + 1])[1][-1] for i in range(len(path))]
        return torch.stack(rows)

    chain = [7, 8, 9, 10, 11]
    cached = CachedModel(model, prompt_length=len(prompt))
    n = len(chain)
    _, hidden = cached.forward_hidden(prompt, chain, list(range(1, n + 1)), torch.ones(n, n, dtype=torch.bool).tril())
    assert torch.equal(hidden, stepped(chain))
    tokens, parents = [7, 8, 9, 10], [-1, -1, 0, 2]  # a tree: rows see the prompt and their ancestors
    cached = CachedModel(model, prompt_length=len(prompt))
    _, hidden = cached.forward_hidden(prompt, tokens, [1, 1, 2, 3], tree_visibility(parents))
    for row, path in enumerate([[7], [8], [7, 9], [7, 9, 10]], start=1):
        assert torch.equal(hidden[row], stepped(path)[-1]), path
    # as lookahead calls it: two guesses first that attend batched (`loose`), the tree after them
    guesses = [3, 4]
    seen = torch.block_diag(torch.ones(2, 2, dtype=torch.bool).tril(), tree_visibility(parents))
    cached = CachedModel(model, prompt_length=len(prompt))
    _, hidden = cached.forward_hidden(prompt, guesses + tokens, [1, 2, 1, 1, 2, 3], seen, loose=(0, 1))
    for row, path in enumerate([[7], [8], [7, 9], [7, 9, 10]], start=3):
        assert torch.equal(hidden[row], stepped(path)[-1]), path
    torch.testing.assert_close(hidden[2], stepped(guesses)[-1], rtol=0.05, atol=0.05)  # close, not exact


def test_q4_is_cpu_only_and_unknown_formats_are_refused():
    with pytest.raises(UserError, match="q4 runs on a CPU"):
        check_format(Q4, "cuda")
    with pytest.raises(UserError, match="unknown weight format"):
        check_format("int3", "cpu")
    check_format(INT8, "cpu")


def test_lora_adapters_stay_float32_on_a_formatted_base():
    from mtp_viz.drafters.mask import MaskSpec, mask_model

    base = formatted(Q4)
    spec = MaskSpec(base="tiny", vocab_size=base.config.vocab_size, hidden_size=base.config.hidden_size, rank=4)
    view = mask_model(base, spec)
    q = view.model.layers[0].self_attn.q_proj
    assert isinstance(q.base_layer, Q4Linear)
    assert q.lora_A["default"].weight.dtype == torch.float32 and type(q.lora_A["default"]) is torch.nn.Linear
    assert q.base_layer.qs is base.model.layers[0].self_attn.q_proj.qs  # shared, not copied


def test_a_copy_shares_the_codes_and_remakes_the_kernel_form():
    model = formatted(Q4)
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(2, layer.in_features)
    expected = layer(x)
    clone = copy.deepcopy(layer, {id(layer.qs): layer.qs, id(layer.d): layer.d, id(layer.m): layer.m})
    assert clone.qs is layer.qs and "_kernel" not in clone.__dict__
    assert torch.equal(clone(x), expected)


def test_engine_records_the_format(use_tiny_registry):
    from mtp_viz.loading import load_model
    from mtp_viz.runner import RunRequest, run

    trace = run(RunRequest(prompt="the cat", model="tiny", weights=INT8, generation=GenerationSettings(4)))
    assert trace.settings["weights"] == INT8 and trace.machine["weights"].startswith("int8 (")
    assert "weights int8" in describe(trace.machine)
    assert load_model("tiny", weights=INT8).weights == INT8
    assert trace.machine["forward"] == LEAN
