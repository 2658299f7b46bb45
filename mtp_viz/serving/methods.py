"""Which of our strategies a vLLM server can run, and how: declared here once, read by the CLI,
the bench, the UI and the tests.

`autoregressive` → no speculation; `prompt_lookup` → vLLM's `ngram` (our draft length and n-gram
sizes); `speculative` → `draft_model` with our draft exported as a plain model directory
(`mtp_viz.serving.export`); `eagle` → `eagle3` with the EAGLE-3 checkpoint directory as it is (our
drafter is saved in vLLM's format), drafting a chain of `depth` tokens. Every other strategy has a
reason it is not served, shown in the UI.
"""

import json
from dataclasses import dataclass
from typing import Any

from mtp_viz.errors import UserError
from mtp_viz.strategies.prompt_lookup import PromptLookupSettings
from mtp_viz.strategies.speculative import CONSTANT, SpeculativeSettings

NGRAM = "ngram"
DRAFT_MODEL = "draft_model"
EAGLE3 = "eagle3"
CHAIN = "chain"  # the `eagle` strategy's one-path draft (its draft_tree setting): what vLLM's EAGLE drafts
EAGLE_CHAIN_NOTE = (
    "vLLM's EAGLE-3 drafts one chain of `depth` tokens per step; our dynamic tree (branching, nodes) has no "
    "counterpart there, so vLLM serves eagle as draft_tree=chain"
)


@dataclass(frozen=True)
class ServedStrategy:
    strategy: str
    method: str | None  # vLLM's speculative method; None: plain decoding
    fixed: tuple[tuple[str, Any], ...] = ()  # settings vLLM's method always runs with
    note: str | None = None  # why `fixed`, recorded with every served run

    def served_values(self, values: dict[str, Any]) -> dict[str, Any]:
        """The strategy settings vLLM runs for these (`fixed` applied; asking for another value of
        a fixed setting is an error, not a silent change)."""
        for name, value in self.fixed:
            if values.get(name, value) != value:
                raise UserError(f"{self.strategy} on vLLM runs with {name}={value} only ({self.note})")
        return {**values, **dict(self.fixed)}

    def speculative_config(self, settings: Any, draft_dir: str | None = None) -> dict | None:
        """vLLM's --speculative-config for our strategy settings (None: no speculation)."""
        if self.method is None:
            return None
        if self.method == NGRAM:
            return {
                "method": NGRAM,
                "num_speculative_tokens": settings.num_draft_tokens,
                "prompt_lookup_max": settings.max_ngram_size,
                "prompt_lookup_min": settings.min_ngram_size,
            }
        if self.method == EAGLE3:
            if draft_dir is None:
                raise UserError("eagle on vLLM needs an EAGLE-3 checkpoint directory")
            return {"method": EAGLE3, "model": draft_dir, "num_speculative_tokens": settings.depth}
        if settings.schedule != CONSTANT:
            raise UserError(f"vLLM drafts a constant number of tokens; schedule={settings.schedule} has no counterpart")
        if draft_dir is None:
            raise UserError("speculative on vLLM needs the draft exported as a model directory")
        return {"method": DRAFT_MODEL, "model": draft_dir, "num_speculative_tokens": settings.num_draft_tokens}


SERVED: dict[str, ServedStrategy] = {
    "autoregressive": ServedStrategy("autoregressive", None),
    "prompt_lookup": ServedStrategy("prompt_lookup", NGRAM),
    "speculative": ServedStrategy("speculative", DRAFT_MODEL),
    "eagle": ServedStrategy("eagle", EAGLE3, fixed=(("draft_tree", CHAIN),), note=EAGLE_CHAIN_NOTE),
}
SETTINGS = {"prompt_lookup": PromptLookupSettings, "speculative": SpeculativeSettings}

NOT_SERVED: dict[str, str] = {
    "lookahead": "vLLM has no lookahead (Jacobi iteration + n-gram pool) decoding",
    "self_speculative": "vLLM has no early-exit self-speculation (its draft must be a separate model)",
    "mtp_heads": (
        "vLLM's Medusa method runs k independent residual blocks on the same hidden state, each with "
        "its own head; our heads are one sequential module fed its own output and the previous guess's "
        "token embedding (DeepSeek-style), which Medusa's checkpoint format cannot express"
    ),
    "conf_adapt": "unverified (lossy) multi-token prediction: vLLM serves only verified speculation",
    "mask_spec": "vLLM has no mask-token drafting (it needs our adapter's <MTP> positions in the forward)",
}


def served(strategy: str) -> ServedStrategy:
    if strategy in SERVED:
        return SERVED[strategy]
    reason = NOT_SERVED.get(strategy, "unknown strategy")
    raise UserError(f"strategy {strategy} cannot run on vLLM: {reason}")


def server_args(speculative_config: dict | None) -> list[str]:
    """The vLLM server arguments a strategy adds (speculation, and per-request acceptance metrics)."""
    if speculative_config is None:
        return []
    return [
        "--speculative-config",
        json.dumps(speculative_config, separators=(",", ":")),
        "--per-request-spec-decode-metrics",
        "detailed",
    ]
