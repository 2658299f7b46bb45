"""Record what vLLM's own n-gram proposer drafts along the recorded prompt-lookup response, for the
parser tests that simulate vLLM under a schedule (tests/test_vllm_parse.py): their expected drafts
must not come from our replay (mtp_viz.serving.traces), the code under test. Run from the
repository root with .venv-vllm installed (`bash scripts/setup.sh --vllm`):

    .venv/bin/python tests/data/vllm/ngram_drafts.py

vLLM's matching function (vllm/v1/spec_decode/ngram_proposer.py) is read from .venv-vllm and run
here as plain Python (its numba decorator dropped; it needs only numpy). It writes
`prompt_lookup-ngram-drafts.json` beside this file: for each draft length k up to the server's,
the ids proposed after the prompt and the first p output ids, for every p."""

import ast
import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent.parent
PROPOSER = "lib/python*/site-packages/vllm/v1/spec_decode/ngram_proposer.py"
MATCH = "_find_longest_matched_ngram_and_propose_tokens"
MAX_MODEL_LEN = 4096  # the recorded server's --max-model-len


def vllm_match():
    """vLLM's n-gram matching function, compiled from its source without numba's decorator."""
    path = next((REPO / ".venv-vllm").glob(PROPOSER))
    tree = ast.parse(path.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == MATCH]
    node.decorator_list = []
    namespace = {"np": np}
    exec(compile(ast.Module([node], type_ignores=[]), str(path), "exec"), namespace)
    version = next((REPO / ".venv-vllm").glob("lib/python*/site-packages/vllm*.dist-info")).name.removesuffix(
        ".dist-info"
    )
    return namespace[MATCH], version


def recorded() -> tuple[list[int], list[int], dict]:
    """The recorded request's prompt ids, the streamed output ids and the speculative config."""
    request = json.loads((HERE / "prompt_lookup-request.json").read_text())
    args = request["server_args"]
    config = json.loads(args[args.index("--speculative-config") + 1])
    output = []
    for line in (HERE / "prompt_lookup-greedy.sse").read_text().splitlines():
        if line.startswith("data: {"):
            output += [t for choice in json.loads(line[len("data: ") :])["choices"] for t in choice["token_ids"]]
    return request["body"]["prompt"], output, config


def main() -> None:
    match, version = vllm_match()
    prompt, output, config = recorded()
    drafts = {
        k: [
            match(
                np.asarray(prompt + output[:p]),
                config["prompt_lookup_min"],
                config["prompt_lookup_max"],
                MAX_MODEL_LEN,
                k,
            ).tolist()
            for p in range(len(output) + 1)
        ]
        for k in range(1, config["num_speculative_tokens"] + 1)
    }
    record = {"proposer": f"{PROPOSER.rsplit('site-packages/', 1)[1]} ({version})", "config": config, "drafts": drafts}
    (HERE / "prompt_lookup-ngram-drafts.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
