"""The EAGLE-3 drafter unrolled for training (mtp_viz.training.eagle), and its labels.

Training-time test (EAGLE-3, Li et al. 2025): the drafter is unrolled `ttt_steps` times, every
position at once. Step 1 reads (token i+1, fuse(features at i)) at position i, as drafting starts
after each verify; step j reads (token i+j, the drafter's own step j−1 output for the same chain)
at position i+j−1, attending to step 1's entries up to i (the committed prefix, built from the
target's features) and to its own chain's entries of steps 2..j, as the drafter sees its cache
when it drafts. Tokens are the sequence's own (a draft only counts while every earlier draft was
right). Step j of chain i is scored against the target's view of position i+j (the token after
next): cross entropy to its argmax and to its top-k distribution renormalised over the draft
vocabulary, answer positions weighted 1 and prompt positions `prompt_weight` (0: then only chains
from a prompt's end on are computed: chain_bases), step j weighted `step_decay` ** (j − 1).
"""

import torch
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from mtp_viz.drafters.eagle3 import Eagle3Drafter


def chain_bases(
    batch: dict[str, torch.Tensor], lookback: int = 0, answer_only: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain bases a loss reads, row by row: from the first whose step-1 label counts (weight
    > 0) to the last, left-aligned as (B, T') positions with a (B, T') mask of the real ones (the
    rest repeat a real base). With prompt positions unweighted, chains based in a prompt, which
    drafting never starts, are not computed: a row's answer decides T', not its prompt.
    `lookback`: that many bases before the first as well (a chain from there reaches a counted
    label at a later step). `answer_only`: labels count where weighted 1 (answers), not > 0 (what
    validation scores, whatever weight a prompt's labels train with)."""
    weight = batch["weight"][:, 1:]  # base i's step-1 label is position i + 1's
    counts = weight == 1.0 if answer_only else weight > 0
    t = counts.shape[1]
    idx = torch.arange(t, device=counts.device).expand_as(counts)
    first = (torch.where(counts, idx, t).min(1).values - lookback).clamp(min=0)
    last = torch.where(counts, idx, -1).max(1).values
    width = max(1, int((last - first + 1).clamp(min=0).max()))
    pos = first.clamp(max=t - 1)[:, None] + torch.arange(width, device=counts.device)
    return pos.clamp(max=t - 1), pos <= last[:, None]


def unroll(
    drafter: Eagle3Drafter,
    batch: dict[str, torch.Tensor],
    steps: int,
    states: list | None = None,
    bases: torch.Tensor | None = None,
):
    """Training-time test: yields (step j, draft logits (B, T', V_d)) for j = 1..steps over the
    chain bases `bases` (B, T') of each row (default every base i < T = L − 1, the same in each
    row; see the module docstring); `states`, if given, gets each step's normed state (B, T', H),
    the one its head reads. Step 1 reads its keys and values at every position: the committed
    prefix the chains attend to."""
    layer, c = drafter.midlayer, drafter.config
    attn = layer.self_attn
    tokens = batch["tokens"]
    b, length = tokens.shape
    t = length - 1
    at = dict(device=tokens.device)
    bases = torch.arange(t, **at).expand(b, t) if bases is None else bases
    width = bases.shape[1]
    fused = drafter.fuse(batch["features"][:, :t].float())  # (B, T, H)
    row = lambda x: x.gather(1, bases[..., None].expand(-1, -1, x.shape[-1]))  # noqa: E731  (B, T, *) → (B, T', *)
    x = torch.cat([layer.input_layernorm(drafter.embed_tokens(tokens[:, 1:])), layer.hidden_norm(fused)], -1)
    k = attn.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)  # (B, kv, T, d)
    cos, sin = drafter.rotary(fused, torch.arange(t, **at)[None])
    keys, values = [_rotated(k, cos, sin)], [attn.v_proj(x).view(b, t, -1, c.head_dim).transpose(1, 2)]
    hidden_prefix = torch.arange(t, **at)[None, None] > bases[..., None]  # (B, T', T): hides step 1's entries > base i
    hidden, x = row(fused), row(x)
    for j in range(1, steps + 1):
        if j > 1:
            step_tokens = F.pad(tokens, (0, j)).gather(1, bases + j)  # token i+j for chain i
            x = torch.cat([layer.input_layernorm(drafter.embed_tokens(step_tokens)), layer.hidden_norm(hidden)], -1)
        cos, sin = drafter.rotary(hidden, bases + j - 1)  # (B, T', d)
        q = _rotated(attn.q_proj(x).view(b, width, c.num_attention_heads, c.head_dim).transpose(1, 2), cos, sin)
        if j > 1:
            keys.append(_rotated(attn.k_proj(x).view(b, width, -1, c.head_dim).transpose(1, 2), cos, sin))
            values.append(attn.v_proj(x).view(b, width, -1, c.head_dim).transpose(1, 2))
        y = _chain_attention(q, keys, values, hidden_prefix)
        h = hidden + attn.o_proj(y.transpose(1, 2).reshape(b, width, -1))
        hidden = h + layer.mlp(layer.post_attention_layernorm(h))
        normed = drafter.norm(hidden)
        if states is not None:
            states.append(normed)
        yield j, drafter.lm_head(normed)


def _chain_attention(q: torch.Tensor, keys: list, values: list, hidden_prefix: torch.Tensor) -> torch.Tensor:
    """Attention of the chains' queries q (B, heads, T', d) to step 1's entries (keys[0], values[0]:
    (B, kv, T, d), those `hidden_prefix` (B, T', T) hides left out) and to their own chain's entries
    of the later steps (keys[s], values[s]: (B, kv, T', d), chain i's at row i). The own-chain part
    is one entry per chain and step, so it is scored elementwise, not as T' keys masked to one (a
    dense masked attention over T + (j − 1)·T' keys did ~2.4x the work over 5 steps)."""
    b, heads, width, d = q.shape
    kv = keys[0].shape[1]
    q = q.view(b, kv, heads // kv, width, d) * d**-0.5  # grouped queries share their key/value head
    prefix = q.flatten(2, 3) @ keys[0].transpose(2, 3)  # (B, kv, g·T', T)
    prefix = prefix.view(b, kv, heads // kv, width, -1).masked_fill(hidden_prefix[:, None, None], float("-inf"))
    own = [(q * k[:, :, None]).sum(-1, keepdim=True) for k in keys[1:]]  # (B, kv, g, T', 1) each
    p = torch.softmax(torch.cat([prefix, *own], -1), -1)
    t = prefix.shape[-1]
    y = (p[..., :t].flatten(2, 3) @ values[0]).view(b, kv, heads // kv, width, d)
    for s, v in enumerate(values[1:]):
        y = y + p[..., t + s : t + s + 1] * v[:, :, None]
    return y.view(b, heads, width, d)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions applied to (B, heads, T, d) by (B or 1, T, d) angles."""
    return apply_rotary_pos_emb(x, x, cos, sin)[0]


def at_step(x: torch.Tensor, j: int, bases: torch.Tensor, fill) -> torch.Tensor:
    """x (B, L, *) at positions bases + j (B, T'), `fill` past the end."""
    padded = F.pad(x, (0, 0, 0, j) if x.dim() == 3 else (0, j), value=fill)
    index = bases + j
    return padded.gather(1, index[..., None].expand(-1, -1, x.shape[2]) if x.dim() == 3 else index)


def step_labels(batch: dict[str, torch.Tensor], j: int, bases: torch.Tensor, real: torch.Tensor | None = None):
    """The labels of step j for chain bases `bases` (B, T'): the target's view of position i + j;
    weight 0 where `real` (B, T') is False."""
    weight = at_step(batch["weight"], j, bases, 0.0)
    return (
        at_step(batch["argmax"], j, bases, -1),
        at_step(batch["topk_ids"], j, bases, -1),
        at_step(batch["topk_p"], j, bases, 0.0),
        weight if real is None else weight * real,
    )
