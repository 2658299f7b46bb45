"""Row labels and leading columns of benchmark tables. A row label is a strategy or a variant of
one ("conf_adapt:tau=0.9"), or a peer, another engine's run on the same prompts in the same
benchmark: transformers' `generate` ("hf_generate", mtp_viz.peers) or a vLLM server
("vllm_prompt_lookup", mtp_viz.serving.peers)."""

HF_PREFIX = "hf_"
VLLM_PREFIX = "vllm_"
PEER_KINDS = {HF_PREFIX: "peer (transformers)", VLLM_PREFIX: "peer (vLLM)"}


def is_peer(label: object) -> bool:
    return str(label).startswith(tuple(PEER_KINDS))


def peer_kind(label: object) -> str:
    """ "peer (transformers)", "peer (vLLM)", or "ours"."""
    return next((kind for prefix, kind in PEER_KINDS.items() if str(label).startswith(prefix)), "ours")


# The bench table leads with what people ask: (column, summary column) for the overall row; the
# Deploy view puts the same columns beside the costs.
BENCH_COLUMNS = {
    "speedup": "speedup",
    "tokens per forward": "mean_accepted_tokens",
    "identical to AR": "identical_share",
    "agreement": "agreement",
    "target NLL": "target_nll",
    "math accuracy": "math_accuracy",
}
