"""An EAGLE-3 drafter's config: the checkpoint's config.json as vLLM reads it (from_hf), and as
we write it for vLLM (to_hf). The drafter itself: mtp_viz.drafters.eagle3."""

from dataclasses import dataclass
from typing import Any

from mtp_viz.errors import UserError

ARCHITECTURE = "LlamaForCausalLMEagle3"
# Variants vLLM's loader knows and this module does not implement: key → the value we support.
UNSUPPORTED = {"num_hidden_layers": 1, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
UNSUPPORTED |= {"fc_norm": False, "norm_output": False, "norm_before_residual": False}


TRAINED_STEPS = "trained_draft_steps"  # our key in config.json (vLLM ignores it): the steps training unrolled


def default_aux_layer_ids(target_layers: int) -> tuple[int, int, int]:
    """vLLM's default when a checkpoint names none (interfaces.py,
    get_eagle3_default_aux_hidden_state_layers). Id k is the residual stream after k decoder
    layers: the target's HF `hidden_states[k]`."""
    return (2, target_layers // 2, target_layers - 3)


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]  # target layers whose residual stream `fc` fuses (low, mid, high)
    norm_before_fc: bool = False  # an RMSNorm (`input_norm`) over the concatenated features
    target_hidden_size: int | None = None  # None: the drafter's own hidden size
    rope_scaling: dict[str, Any] | None = None  # a Llama `rope_scaling` (e.g. llama3), None: plain RoPE
    trained_steps: int | None = None  # draft steps its training unrolled (ours; None: not recorded)

    @property
    def fc_input_size(self) -> int:
        return len(self.aux_layer_ids) * (self.target_hidden_size or self.hidden_size)

    @classmethod
    def from_hf(cls, config: dict[str, Any], target_layers: int | None = None) -> "Eagle3Config":
        """A checkpoint's config.json. `target_layers` supplies vLLM's default layer ids when it names none."""
        for key, supported in UNSUPPORTED.items():
            if config.get(key, supported) != supported:
                raise UserError(f"EAGLE-3 config: {key}={config[key]!r} is not supported here (only {supported!r})")
        eagle = config.get("eagle_config") or {}
        if not eagle.get("use_aux_hidden_state", True):
            raise UserError("EAGLE-3 config: use_aux_hidden_state=false (EAGLE-1 style) is not supported here")
        # the order gpu_model_runner._get_eagle3_aux_layers_from_config reads them in
        layer_ids = config.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        if not layer_ids:
            if target_layers is None:
                raise UserError(
                    "EAGLE-3 config names no eagle_aux_hidden_state_layer_ids: give the target's layer count"
                )
            layer_ids = default_aux_layer_ids(target_layers)
        missing = [
            k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in config
        ]
        if missing:
            raise UserError(f"EAGLE-3 config.json lacks {', '.join(missing)}")
        rope = dict(config.get("rope_parameters") or {})  # transformers 5 spelling
        scaling = config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        heads = config["num_attention_heads"]
        return cls(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=config.get("rope_theta") or rope.get("rope_theta", 10000.0),
            max_position_embeddings=config.get("max_position_embeddings", 8192),
            vocab_size=config["vocab_size"],
            draft_vocab_size=config.get("draft_vocab_size") or config["vocab_size"],
            aux_layer_ids=tuple(int(i) for i in layer_ids),
            norm_before_fc=bool(eagle.get("norm_before_fc", config.get("norm_before_fc", False))),
            target_hidden_size=config.get("target_hidden_size"),
            rope_scaling={k: v for k, v in scaling.items() if k != "rope_theta"} if scaling else None,
            trained_steps=config.get(TRAINED_STEPS),
        )

    def to_hf(self) -> dict[str, Any]:
        """The config.json vLLM's speculative path reads for method "eagle3"."""
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",  # parsed as a LlamaConfig, then wrapped in vLLM's EAGLEConfig
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False,  # the head scores the draft vocabulary, never the embedding
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                "use_aux_hidden_state": True,
                "norm_before_fc": self.norm_before_fc,
            },
        } | UNSUPPORTED
        if self.target_hidden_size is not None:
            config["target_hidden_size"] = self.target_hidden_size
        if self.rope_scaling is not None:
            config["rope_scaling"] = dict(self.rope_scaling)
        if self.trained_steps is not None:
            config[TRAINED_STEPS] = self.trained_steps
        return config
