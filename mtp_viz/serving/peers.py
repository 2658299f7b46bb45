"""vLLM as a peer in our benchmark: a server per served strategy, started before the benchmark
times anything and stopped after it, answering the same prompts one at a time (one client),
interleaved with our runs so that every ratio is measured side by side in one run."""

import contextlib
from collections.abc import Callable
from dataclasses import replace

import httpx

from mtp_viz.errors import UserError
from mtp_viz.labels import VLLM_PREFIX
from mtp_viz.peers import PeerRun
from mtp_viz.runner import RunRequest
from mtp_viz.serving.backend import VLLMPlan, open_server, plan, request_body, warm_up
from mtp_viz.serving.client import complete
from mtp_viz.serving.methods import SERVED
from mtp_viz.serving.server import ServerError, VLLMServer

VLLM_PEERS = tuple(VLLM_PREFIX + s for s in SERVED)


class VLLMPeers(contextlib.ExitStack):
    """`with VLLMPeers(names, base, settings_for) as peers: peers.run(name, prompt_ids)`."""

    def __init__(
        self,
        names: list[str],
        base: RunRequest,
        settings_for: Callable[[str], dict] = lambda s: {},
        progress: Callable[[str], None] | None = None,
    ):
        super().__init__()
        unknown = [n for n in names if n not in VLLM_PEERS]
        if unknown:
            raise UserError(f"unknown vLLM peer {', '.join(unknown)}; choose from {', '.join(VLLM_PEERS)}")
        self.names, self.progress = names, progress
        strategies = {n: n.removeprefix(VLLM_PREFIX) for n in names}
        self.plans: dict[str, VLLMPlan] = {
            n: plan(replace(base, strategy=s, strategy_settings=settings_for(s))) for n, s in strategies.items()
        }
        self.servers: dict[str, VLLMServer] = {}
        self.client = httpx.Client()

    def __enter__(self) -> "VLLMPeers":
        super().__enter__()
        self.callback(self.client.close)
        try:
            for name, p in self.plans.items():
                server = self.enter_context(open_server(p, progress=self.progress))
                warm_up(self.client, server, p)
                self.servers[name] = server
        except BaseException:
            self.close()
            raise
        return self

    def run(self, name: str, prompt_ids: list[int]) -> PeerRun:
        """One greedy completion of the prompt (the benchmark's generation settings)."""
        p, server = self.plans[name], self.servers[name]
        body = request_body(p, prompt_ids)
        try:
            c = complete(self.client, server.url, body)
        except httpx.HTTPError as e:
            raise ServerError(f"{name}: the vLLM request failed: {e}") from None
        text = p.target.tokenizer.decode(c.token_ids, skip_special_tokens=False) if p.target.tokenizer else c.text
        return PeerRun(name, c.token_ids, text, c.wall_s)
