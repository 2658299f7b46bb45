"""A drafter loaded inside the vLLM server (speculative method `custom_class`), so that vLLM
verifies exactly k tokens per sequence per step: the cost of a step of B sequences × k tokens is
then measured on the serving engine itself (`mtp_viz.serving.engine_profile`).

k is read from the request: its first prompt token is CODE_BASE + k (capped at the server's
num_speculative_tokens). Every step proposes k copies of the last sampled token, which the target
mostly rejects; accepted or not, the step scores k + 1 tokens per sequence. Imported by vLLM from
this folder on its PYTHONPATH: standard library only, no mtp_viz imports."""

CODE_BASE = 1000  # first prompt token = CODE_BASE + draft length


def draft_length(first_token: int, most: int) -> int:
    """The draft length a request asks for through its first prompt token."""
    k = first_token - CODE_BASE
    return min(k, most) if 0 <= k <= most else 0


class ForcedDrafts:
    """vLLM's custom proposer interface (0.32): constructed with the VllmConfig; `propose` returns
    one list of draft token ids per request of the batch."""

    def __init__(self, vllm_config):
        self.most = int(vllm_config.speculative_config.num_speculative_tokens)

    def load_model(self, *args, **kwargs) -> None:
        """Nothing to load."""

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **kwargs):
        drafts = []
        for i, sampled in enumerate(sampled_token_ids):
            if len(sampled) == 0:  # a request still in its prefill
                drafts.append([])
                continue
            k = draft_length(int(token_ids_cpu[i][0]), self.most)
            drafts.append([int(sampled[-1])] * k)
        return drafts
