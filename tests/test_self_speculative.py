"""Self-speculation's split model: lower then upper layers over one shared cache compute exactly
what the whole model computes, and the draft's early-layer key/values are reused, not recomputed."""

import torch
from conftest import decode, tiny_model

from mtp_viz.errors import UserError
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.strategies.self_speculative import SplitModel

PROMPT = [5, 17, 3, 42, 9, 17, 3]


def test_lower_then_upper_is_the_whole_model():
    model = tiny_model("llama-3l-mha", seed=0)
    split = SplitModel(model, exit_layer=1, vocab_size=model.config.vocab_size, prompt_length=len(PROMPT))
    logits = split.upper(split.lower(PROMPT))  # prefill through both stacks
    with torch.no_grad():
        full = model(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(logits, full, atol=1e-4, rtol=1e-4)
    # one more token, then a block of two, against the cache
    more = split.upper(split.lower([7]))
    block = split.upper(split.lower([8, 9]))
    with torch.no_grad():
        full = model(torch.tensor([PROMPT + [7, 8, 9]])).logits[0, -3:]
    torch.testing.assert_close(torch.cat([more, block]), full, atol=1e-4, rtol=1e-4)
    split.crop(len(PROMPT) + 1)
    assert split.lower_len == split.upper_len == len(PROMPT) + 1


def test_early_layers_run_once_per_token():
    """Count the tokens each layer processes. The early layers see each fed position once, while
    drafting, and verification does not run them again, so they process exactly as many tokens as
    the late layers (a separate early-exit draft would run them on every guess twice)."""
    model = tiny_model("llama-3l-mha", seed=0)
    seen = [0] * model.config.num_hidden_layers
    for i, layer in enumerate(model.model.layers):  # a layer's output projection sees every token it runs on
        proj = layer.self_attn.o_proj
        proj.register_forward_hook(lambda m, args, out, i=i: seen.__setitem__(i, seen[i] + args[0].shape[-2]))
    out, steps = decode(model, "self_speculative", PROMPT, GenerationSettings(max_new_tokens=20), exit_layer=2)
    drafted = sum(len(s.drafted) for s in steps)
    fed_upper = len(PROMPT) + sum(len(s.drafted) + 1 for s in steps[1:])
    assert seen[2] == fed_upper  # the upper layer: prompt, then root + guesses per step
    assert seen[0] == seen[1] == len(PROMPT) + drafted + len(steps) - 1 == fed_upper  # root + k guesses, once


def test_exit_layer_must_leave_layers_to_verify():
    model = tiny_model("llama-2l", seed=0)
    try:
        decode(model, "self_speculative", PROMPT, exit_layer=2)
    except UserError as e:
        assert "exit_layer" in str(e)
    else:
        raise AssertionError("exit_layer = number of layers must be refused")
