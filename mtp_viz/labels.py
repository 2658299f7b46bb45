"""Row labels and leading columns of benchmark tables. A row label is a strategy or a variant of
one ("conf_adapt:tau=0.9"), or a peer, another engine's run on the same prompts in the same
benchmark: transformers' `generate` ("hf_generate", mtp_viz.peers), a vLLM server
("vllm_prompt_lookup", mtp_viz.serving.peers) or llama.cpp on the shipped GGUF
("llama_cpp_autoregressive", mtp_viz.llama_peers)."""

HF_PREFIX = "hf_"
VLLM_PREFIX = "vllm_"
LLAMA_CPP_PREFIX = "llama_cpp_"
PEER_KINDS = {HF_PREFIX: "peer (transformers)", VLLM_PREFIX: "peer (vLLM)", LLAMA_CPP_PREFIX: "peer (llama.cpp)"}


def is_peer(label: object) -> bool:
    return str(label).startswith(tuple(PEER_KINDS))


def peer_kind(label: object) -> str:
    """ "peer (transformers)", "peer (vLLM)", "peer (llama.cpp)", or "ours"."""
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
