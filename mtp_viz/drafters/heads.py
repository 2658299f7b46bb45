"""Sequential multi-token-prediction heads on a frozen target's hidden states.

One module f(h_t, x_{t+1}) → ĥ_{t+1} predicts the target's next final hidden state from its
current one and the next token; the target's head (through the reduced vocabulary) reads the
logits of x_{t+2} from ĥ_{t+1}. Applied k times, each time on its own output and its own
previous guess, it proposes x_{t+2} … x_{t+k+1}. This is DeepSeek-V3's sequential MTP module
with an MLP block in place of its transformer block (as Hydra's heads are MLPs) and one set of
weights for every depth (as EAGLE shares its draft layer): the function it learns, "the next
hidden state", is the same at every depth, and no KV cache is needed, so the heads are
stateless and cheap on a CPU.

Trained by self-distillation (mtp_viz.training.heads): the target's own argmax and top-k
distribution at t+j are the labels of depth j, and its real hidden states the regression targets.
"""

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel

from mtp_viz.drafters.vocab import ReducedHead
from mtp_viz.errors import UserError
from mtp_viz.kernels import plan_of, use_fast_linears

SPEC_FILE = "heads.json"
WEIGHTS_FILE = "weights.safetensors"
SHARED = ("embed.", "head.")  # the target's modules, neither trained nor shipped


@dataclass(frozen=True)
class HeadsSpec:
    base: str  # registry id of the target they were trained for
    hidden_size: int
    intermediate_size: int
    vocab_size: int  # the target's full vocabulary
    reduced_vocab: int
    trained_depth: int  # depths unrolled in training; deeper guesses degrade faster
    eps: float = 1e-5


class MTPHeads(nn.Module):
    def __init__(self, spec: HeadsSpec, embed: nn.Embedding, head: ReducedHead):
        super().__init__()
        h, i = spec.hidden_size, spec.intermediate_size
        self.spec = spec
        self.embed = embed
        self.head = head
        self.norm_hidden = nn.RMSNorm(h, eps=spec.eps)
        self.norm_token = nn.RMSNorm(h, eps=spec.eps)
        self.fuse = nn.Linear(2 * h, h, bias=False)
        self.norm_mlp = nn.RMSNorm(h, eps=spec.eps)
        self.gate = nn.Linear(h, i, bias=False)
        self.up = nn.Linear(h, i, bias=False)
        self.down = nn.Linear(i, h, bias=False)
        self.norm_out = nn.RMSNorm(h, eps=spec.eps)

    def step(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """hidden (N, H) at position t, tokens (N,) = x_{t+1} → predicted hidden (N, H) at t+1."""
        x = self.fuse(torch.cat([self.norm_hidden(hidden), self.norm_token(self.embed(tokens))], dim=-1))
        y = self.norm_mlp(x)
        x = x + self.down(nn.functional.silu(self.gate(y)) * self.up(y))
        return self.norm_out(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, H) → (N, V) full-vocabulary logits (−inf outside the reduced vocabulary)."""
        return self.head(hidden)

    @torch.inference_mode()
    def chain(self, hidden: torch.Tensor, token: int, k: int) -> tuple[list[int], torch.Tensor]:
        """Greedy chain of k guesses after `token`, from the target's hidden (H,) that produced it.

        Returns the guessed ids and their logits (k, V)."""
        h = hidden[None]  # (1, H)
        t = torch.tensor([token], device=hidden.device)
        ids, rows = [], []
        for _ in range(k):
            h = self.step(h, t)
            logits = self.logits(h)[0].float()  # (V,)
            t = logits.argmax()[None]
            ids.append(int(t))
            rows.append(logits)
        return ids, torch.stack(rows) if rows else hidden.new_zeros(0, self.spec.vocab_size)


def build_heads(target: PreTrainedModel, spec: HeadsSpec, vocab_ids: torch.Tensor) -> MTPHeads:
    """New heads, started near the identity on the hidden path with the target's last MLP block."""
    head = ReducedHead(target.lm_head.weight, vocab_ids.to(target.device), spec.vocab_size)
    heads = MTPHeads(spec, target.model.embed_tokens, head).to(device=target.device, dtype=target.dtype)
    use_fast_linears(heads, plan_of(target))  # the target's linear path (measured on its shapes)
    h = spec.hidden_size
    last = target.model.layers[-1]
    with torch.no_grad():
        heads.fuse.weight.zero_()
        heads.fuse.weight[:, :h].copy_(torch.eye(h))
        heads.fuse.weight[:, h:].normal_(0.0, 0.02)
        mlp = getattr(last, "mlp", None)
        if mlp is not None and hasattr(mlp, "gate_proj") and mlp.gate_proj.weight.shape == heads.gate.weight.shape:
            heads.gate.weight.copy_(mlp.gate_proj.weight)
            heads.up.weight.copy_(mlp.up_proj.weight)
            heads.down.weight.copy_(mlp.down_proj.weight)
        heads.norm_out.weight.copy_(target.model.norm.weight)
    return heads


def trained_parameters(heads: MTPHeads) -> dict[str, nn.Parameter]:
    return {n: p for n, p in heads.named_parameters() if not n.startswith(SHARED)}


def save_heads(heads: MTPHeads, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    tensors = {n: p.detach().to("cpu", torch.float16).contiguous() for n, p in trained_parameters(heads).items()}
    tensors["vocab_ids"] = heads.head.ids.to("cpu", torch.int32)
    save_file(tensors, path / WEIGHTS_FILE)
    (path / SPEC_FILE).write_text(json.dumps(asdict(heads.spec), indent=1))


def load_heads(target: PreTrainedModel, path: Path) -> MTPHeads:
    """Saved heads around `target`'s embedding and head rows, as plain modules (the loading
    pipeline gives them the target's format and kernel plan)."""
    if not (path / SPEC_FILE).is_file():
        raise UserError(f"{path} holds no trained heads ({SPEC_FILE} missing)")
    spec = HeadsSpec(**json.loads((path / SPEC_FILE).read_text()))
    if (spec.hidden_size, spec.vocab_size) != (target.config.hidden_size, target.config.vocab_size):
        raise UserError(f"heads in {path} were trained for another target ({spec.base})")
    tensors = load_file(path / WEIGHTS_FILE)
    head = ReducedHead(target.lm_head.weight, tensors.pop("vocab_ids").long().to(target.device), spec.vocab_size)
    heads = MTPHeads(spec, target.model.embed_tokens, head).to(device=target.device, dtype=target.dtype)
    params = trained_parameters(heads)
    with torch.no_grad():
        for name, value in tensors.items():
            params[name].copy_(value.to(params[name].dtype))
    return heads.eval()
