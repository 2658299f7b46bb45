"""Would a richer MTP-heads architecture close the gap to the issue-4 goals? An experiment, not
shipped code: it trains an EAGLE-style variant of the shipped heads for a fixed number of steps on
the cached training data (`python -m mtp_viz train data`) and compares its depth-1 top-1
agreement with the target (teacher-forced) against the shipped heads', on the training run's
validation split and on the target's greedy answers to Spec-Bench prompts:

    .venv/bin/python experiments/heads_variants.py --variant attention --steps 1000
    .venv/bin/python experiments/heads_variants.py --variant attention --steps 400 --subset 800
    .venv/bin/python experiments/heads_variants.py --variant attention+layers --steps 400 --subset 800

(`--data DIR` reads another `train data` folder; `--per-category N` answers fewer Spec-Bench
prompts: both for trying it at a small size.) These three runs produced the table of
docs/training.md, "Two richer heads architectures" (2026-12-03, on the stage-2 cache of 2,090
sequences); their logs are docs/results/heads-variants/attention-1000.log, attention-400-800.log
and layers-400-800.log. Neither variant was built into the strategies.

- attention: the shipped heads' block (fuse h_t with x_{t+1}, SwiGLU MLP, final norm; started
  from the shipped weights) with one causal self-attention layer between fuse and MLP, over every
  earlier (hidden, token) entry (started from the target's last attention layer, its output scaled
  by 0.1): EAGLE's draft layer. Trained with EAGLE's uniform feature noise, cross entropy to the
  target's argmax and a smooth-L1 pull towards its next hidden state.
- attention+layers: the same, also fed the target's hidden states after layers 4 and 16 (EAGLE-3's
  multi-layer features). The cache holds only the final hidden state, so one teacher-forced target
  forward per sequence adds them (about 6 minutes for 950 sequences on 2 cores); --subset bounds
  the number of training sequences (every other one, from the start) for both variants alike.

Depth 1 only: enough to decide whether the variant is worth building into the strategies.
Agreement counts only positions whose target token is in the heads' reduced vocabulary (a token
outside it can never be guessed: 6.2% of the validation positions), so it reads higher than the
training run's own figures; shipped heads and variant are compared on identical positions. The
Spec-Bench answers are the target's greedy 96 tokens to the first 3 prompts of each category,
each prompt cut to its last 700 tokens, generated in left-padded batches of 8.
"""

import argparse
import math
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from mtp_viz.loading import load_heads_for, load_model, quiet_transformers
from mtp_viz.paths import cache_root
from mtp_viz.training.data import load_sequences
from mtp_viz.training.heldout import answer, spec_bench_prompts

MODEL = "smollm2-135m"
EXTRA_LAYERS = (4, 16)  # hidden_states indices: after decoder layers 4 and 16 of 30
TOKENS_PER_BATCH = 2048
SPEC_BENCH_PER_CATEGORY = 3


class AttentionHeads(nn.Module):
    """The shipped heads' block with a causal attention layer over the sequence of entries."""

    def __init__(self, target, shipped, extra_layers: int):
        super().__init__()
        cfg = target.config
        h = cfg.hidden_size
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = h // self.nh
        self.shipped = shipped  # its embed (frozen), head (frozen) and started-from weights
        self.rotary = target.model.rotary_emb  # the target's own rotary embedding (no parameters)
        eps = cfg.rms_norm_eps
        self.extra_norms = nn.ModuleList(nn.RMSNorm(h, eps=eps) for _ in range(extra_layers))
        self.norm_hidden, self.norm_token = nn.RMSNorm(h, eps=eps), nn.RMSNorm(h, eps=eps)
        self.fuse = nn.Linear((2 + extra_layers) * h, h, bias=False)
        self.norm_attn = nn.RMSNorm(h, eps=eps)
        self.q = nn.Linear(h, self.nh * self.hd, bias=False)
        self.k = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.o = nn.Linear(self.nh * self.hd, h, bias=False)
        self.norm_mlp = nn.RMSNorm(h, eps=eps)
        self.gate = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.norm_out = nn.RMSNorm(h, eps=eps)
        last = target.model.layers[-1].self_attn
        with torch.no_grad():
            self.fuse.weight.zero_()
            self.fuse.weight[:, : 2 * h].copy_(shipped.fuse.weight)
            for name in ("norm_hidden", "norm_token", "norm_mlp", "gate", "up", "down", "norm_out"):
                getattr(self, name).weight.copy_(getattr(shipped, name).weight)
            self.norm_attn.weight.copy_(target.model.layers[-1].input_layernorm.weight)
            for mine, theirs in ((self.q, last.q_proj), (self.k, last.k_proj), (self.v, last.v_proj)):
                mine.weight.copy_(theirs.weight)
            self.o.weight.copy_(last.o_proj.weight * 0.1)
        for p in shipped.parameters():
            p.requires_grad_(False)

    def trained(self) -> list[nn.Parameter]:
        return [p for n, p in self.named_parameters() if not n.startswith("shipped.")]

    def forward(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """features (B, L, (1+e)·H): final hidden state, then the extra layers'; tokens (B, L) → (B, L, H)."""
        b, length, _ = features.shape
        h = self.norm_hidden.weight.shape[0]
        parts = [self.norm_hidden(features[..., :h]), self.norm_token(self.shipped.embed(tokens))]
        parts += [norm(features[..., (j + 1) * h : (j + 2) * h]) for j, norm in enumerate(self.extra_norms)]
        x = self.fuse(torch.cat(parts, -1))
        y = self.norm_attn(x)
        q = self.q(y).view(b, length, self.nh, self.hd).transpose(1, 2)
        k = self.k(y).view(b, length, self.nkv, self.hd).transpose(1, 2)
        v = self.v(y).view(b, length, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *self.rotary(v, torch.arange(length)[None]))
        rep = self.nh // self.nkv
        a = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, length, -1))
        y = self.norm_mlp(x)
        x = x + self.down(F.silu(self.gate(y)) * self.up(y))
        return self.norm_out(x)


def shipped_forward(shipped, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    h = shipped.spec.hidden_size
    flat = features[..., :h].reshape(-1, h)
    return shipped.step(flat, tokens.reshape(-1)).view(*tokens.shape, h)


@torch.inference_mode()
def add_layer_features(model, seqs) -> None:
    """Append the extra layers' hidden states to each sequence's cached final hidden states."""
    for s in seqs:
        out = model.model(input_ids=s.tokens[None, :-1].long(), output_hidden_states=True)
        s.hidden = torch.cat([s.hidden] + [out.hidden_states[i][0].half() for i in EXTRA_LAYERS], -1)


def batches(seqs, budget: int = TOKENS_PER_BATCH) -> list[list[int]]:
    """Sequence indices grouped by length into batches of about `budget` padded tokens."""
    out, current = [], []
    for i in sorted(range(len(seqs)), key=lambda i: len(seqs[i].tokens)):
        if current and (len(current) + 1) * len(seqs[i].tokens) > budget:
            out.append(current)
            current = []
        current.append(i)
    return out + [current] if current else out


def collate(seqs, index: torch.Tensor, h: int):
    """Entry i of a sequence = (features at i, token i+1); its labels are the target's view of
    position i+1 (argmax as a reduced id, −1 at prompt positions and padding; next hidden state)."""
    length = max(len(s.tokens) for s in seqs) - 2
    feats = torch.zeros(len(seqs), length, seqs[0].hidden.shape[-1])
    tokens = torch.zeros(len(seqs), length, dtype=torch.long)
    labels = torch.full((len(seqs), length), -1, dtype=torch.long)
    next_hidden = torch.zeros(len(seqs), length, h)
    for r, s in enumerate(seqs):
        n = len(s.tokens) - 2
        feats[r, :n] = s.hidden[:n].float()
        tokens[r, :n] = s.tokens[1 : n + 1].long()
        row = index[s.argmax[1 : n + 1].long()]
        row[: max(0, s.prompt_len - 1)] = -1
        labels[r, :n] = row
        next_hidden[r, :n] = s.hidden[1 : n + 1, :h].float()
    return feats, tokens, labels, next_hidden


@torch.no_grad()
def agreement(fn, head, seqs, index, h: int) -> float:
    right = total = 0
    for group in batches(seqs):
        feats, tokens, labels, _ = collate([seqs[i] for i in group], index, h)
        guess = head.reduced(fn(feats, tokens)).argmax(-1)
        right += int(((guess == labels) & (labels >= 0)).sum())
        total += int((labels >= 0).sum())
    return right / max(1, total)


def spec_bench_answers(target, per_category: int):
    """The target's greedy answers (96 tokens) to the first prompts of every Spec-Bench category."""
    return answer(target, spec_bench_prompts(per_category))


def data_folder(arg: str | None, target) -> Path:
    """`train data`'s folder for the target: the given one, else its default in the cache."""
    return Path(arg) if arg else cache_root() / "train" / target.name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=("attention", "attention+layers"), default="attention")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--subset", type=int, default=0, help="train on this many sequences (0: all)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--data", help="`train data` folder (default: <cache>/train/<model>)")
    p.add_argument("--per-category", type=int, default=SPEC_BENCH_PER_CATEGORY, help="Spec-Bench prompts answered")
    args = p.parse_args()
    quiet_transformers()
    torch.manual_seed(0)
    target = load_model(MODEL, "cpu", "float32")
    _, shipped = load_heads_for(target)
    h, index = shipped.spec.hidden_size, shipped.head.index.cpu()
    data = data_folder(args.data, target)
    train = list(load_sequences(data, 20, holdout=False))
    val = list(load_sequences(data, 20, holdout=True))
    if args.subset:
        train = train[::2][: args.subset]
    bench = spec_bench_answers(target, args.per_category)
    extra = args.variant == "attention+layers"
    if extra:
        started = time.perf_counter()
        add_layer_features(target.model, train + val + bench)
        print(f"layer features: {time.perf_counter() - started:.0f} s", flush=True)
    net = AttentionHeads(target.model, shipped, len(EXTRA_LAYERS) if extra else 0)
    print(f"{len(train)} training sequences ({sum(len(s.tokens) for s in train)} tokens), {len(val)} validation")
    mine = lambda f, t: net(f, t)  # noqa: E731
    theirs = lambda f, t: shipped_forward(shipped, f, t)  # noqa: E731
    for name, seqs in (("validation split", val), ("Spec-Bench answers", bench)):
        print(
            f"before: {name}: shipped {agreement(theirs, shipped.head, seqs, index, h):.3f}, "
            f"variant {agreement(mine, shipped.head, seqs, index, h):.3f}",
            flush=True,
        )
    params = net.trained()
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    order = batches(train)
    perm = torch.randperm(len(order), generator=torch.Generator().manual_seed(0)).tolist()
    started = time.perf_counter()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / 30) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        feats, tokens, labels, next_hidden = collate([train[i] for i in order[perm[step % len(order)]]], index, h)
        feats = feats + (torch.rand_like(feats) - 0.5) * 0.2  # EAGLE's feature noise
        out = net(feats, tokens)
        logp = torch.log_softmax(shipped.head.reduced(out).float(), -1)
        mask = labels >= 0
        ce = -(logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * mask).sum() / mask.sum()
        reg = (F.smooth_l1_loss(out, next_hidden, reduction="none").mean(-1) * mask).sum() / mask.sum()
        optimizer.zero_grad()
        (ce + 0.1 * reg).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if (step + 1) % 100 == 0 or step + 1 == args.steps:
            print(
                f"step {step + 1} ({time.perf_counter() - started:.0f} s): cross entropy {ce.item():.3f}, "
                f"validation {agreement(mine, shipped.head, val, index, h):.3f}",
                flush=True,
            )
    for name, seqs in (("validation split", val), ("Spec-Bench answers", bench)):
        print(
            f"after {args.steps} steps: {name}: shipped {agreement(theirs, shipped.head, seqs, index, h):.3f}, "
            f"variant {agreement(mine, shipped.head, seqs, index, h):.3f}"
        )


if __name__ == "__main__":
    main()
