"""The Gradio app against a launched server (tiny models via a registry override): the named `run` and
`compare` endpoints through gradio_client, bad input as messages, the app still serving after."""

import inspect
import json
import threading

import pytest
from bad_inputs import CASES
from bad_inputs import request as corpus_request

from mtp_viz.strategies.prompt_lookup import DEFAULT_DRAFT_TOKENS
from mtp_viz.trace import SCHEMA_VERSION
from mtp_viz.ui.app import api_run


@pytest.fixture(scope="module")
def client(served_app):
    from gradio_client import Client

    return Client(served_app, verbose=False)


def test_named_endpoints_are_listed(client):
    named = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    assert {"/run", "/compare"} <= set(named)


def test_run_endpoint_returns_a_trace(client):
    trace = client.predict(
        "the cat sat on the mat", model="tiny", strategy="prompt_lookup", max_new_tokens=10, api_name="/run"
    )
    assert (
        trace["strategy"] == "prompt_lookup" and trace["model"] == "tiny" and trace["schema_version"] == SCHEMA_VERSION
    )
    assert len(trace["output_token_ids"]) <= 10
    assert trace["settings"]["num_draft_tokens"] == DEFAULT_DRAFT_TOKENS  # the strategy's own default


def test_run_endpoint_with_a_draft_and_sampling(client):
    trace = client.predict(
        "the dog ran",
        model="tiny",
        strategy="speculative",
        draft="tiny-draft",
        num_draft_tokens=3,
        temperature=0.8,
        top_p=0.9,
        seed=3,
        max_new_tokens=8,
        api_name="/run",
    )
    assert trace["draft_model"] == "tiny-draft" and trace["settings"]["num_draft_tokens"] == 3
    assert trace["settings"]["temperature"] == 0.8


def test_run_endpoint_takes_any_strategy_setting(client):
    trace = client.predict(
        "the cat sat on the mat and the cat sat",
        model="tiny",
        strategy="lookahead",
        max_new_tokens=10,
        settings={"level": 3, "window": 4, "guess": 2, "pool_from_prompt": True},
        api_name="/run",
    )
    assert trace["strategy"] == "lookahead"
    assert trace["settings"]["window"] == 4 and trace["settings"]["pool_from_prompt"] is True


def test_compare_endpoint(client):
    result = client.predict(
        "the cat sat on the mat and the cat",
        ["speculative", "prompt_lookup"],
        model="tiny",
        max_new_tokens=12,
        api_name="/compare",
    )
    assert [t["strategy"] for t in result["traces"]] == ["autoregressive", "speculative", "prompt_lookup"]
    assert result["verdicts"] == {
        "speculative": "identical to autoregressive",
        "prompt_lookup": "identical to autoregressive",
    }
    assert result["metrics"][0]["speedup"] == 1.0


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"prompt": "   "}, "prompt is empty"),
        ({"prompt": "hi", "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "strategy": "telepathy"}, "unknown strategy"),
        ({"prompt": "hi", "model": "gpt-9"}, "unknown model"),
        ({"prompt": "hi", "strategy": "speculative", "draft": "tiny-other"}, "different vocabulary"),
        ({"prompt": "hi", "strategy": "lookahead", "settings": {"window": 0}}, "window"),
        ({"prompt": "hi", "strategy": "mtp_heads", "settings": {"tree": "0,x"}}, "tree"),
        ({"prompt": "hi", "strategy": "mtp_heads"}, "no MTP heads"),
        ({"prompt": "hi", "strategy": "conf_adapt", "settings": {"tau": "high"}}, "tau"),
        ({"prompt": "hi", "model": "/etc/passwd"}, "registry"),
    ],
)
def test_bad_input_is_a_message_and_the_app_keeps_serving(client, kwargs, message):
    kwargs.setdefault("model", "tiny")
    with pytest.raises(Exception, match=message):
        client.predict(**kwargs, api_name="/run")
    trace = client.predict("a bird", model="tiny", max_new_tokens=3, api_name="/run")
    assert len(trace["output_token_ids"]) <= 3


def raw_call(url: str, api_name: str, kwargs: dict) -> tuple[str, object]:
    """Call a named endpoint over plain HTTP, as any client may: the JSON may carry NaN and lone
    surrogates (escaped), which gradio_client refuses to send. Returns the final event and data."""
    import httpx

    names = list(inspect.signature(api_run).parameters)
    defaults = {n: p.default for n, p in inspect.signature(api_run).parameters.items()}
    data = [kwargs.get(n, defaults[n]) for n in names]
    body = json.dumps({"data": data}, ensure_ascii=True, allow_nan=True)
    base = f"{url.rstrip('/')}/gradio_api/call/{api_name}"
    with httpx.Client(timeout=60) as http:
        event_id = http.post(base, content=body, headers={"content-type": "application/json"}).json()["event_id"]
        text = http.get(f"{base}/{event_id}").text
    events = [line.removeprefix("event: ") for line in text.splitlines() if line.startswith("event: ")]
    payloads = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    return events[-1], json.loads(payloads[-1]) if payloads[-1] not in ("", "null") else None


@pytest.mark.parametrize("name", CASES)
def test_shared_bad_input_corpus_through_the_api(served_app, client, name):
    """The corpus test_cli.py runs through the CLI: a message (never a traceback), or a trace for
    odd but valid prompts; the app serves a normal request after each."""
    case = CASES[name]
    event, data = raw_call(served_app, "run", corpus_request(case))
    if case.expect is None:
        assert event == "complete", data
        assert data[0]["prompt_token_ids"] and data[0]["schema_version"] == SCHEMA_VERSION
    else:
        assert event == "error" and case.expect in str(data), (event, data)
        assert "Traceback" not in str(data)
    trace = client.predict("a bird", model="tiny", max_new_tokens=3, api_name="/run")
    assert len(trace["output_token_ids"]) <= 3


def test_sixteen_concurrent_api_users_get_what_they_would_get_alone(served_app, client):
    """16 gradio_client users, 3 requests each, mixed strategies: no errors, and every greedy
    result token-identical to the same request made alone (no KV-cache cross-talk)."""
    from gradio_client import Client

    prompts = ["the cat sat", "a bird sang a song", "the dog ran to the park", "def add ( a , b )"]
    strategies = [
        ("autoregressive", {}),
        ("speculative", {"draft": "tiny-draft"}),
        ("prompt_lookup", {}),
        ("lookahead", {"settings": {"level": 3, "window": 3, "guess": 3}}),
    ]
    jobs = [
        [
            {"prompt": prompts[(user + i) % 4], "strategy": strategies[(user // 4 + i) % 4][0], "max_new_tokens": 12}
            | strategies[(user // 4 + i) % 4][1]
            for i in range(3)
        ]
        for user in range(16)
    ]
    key = lambda job: json.dumps(job, sort_keys=True)  # noqa: E731
    unique = {key(job): job for u in jobs for job in u}
    alone = {k: client.predict(**job, model="tiny", api_name="/run")["output_token_ids"] for k, job in unique.items()}
    errors, results = [], {}

    def user(jobs_of_user):
        try:
            own = Client(served_app, verbose=False)
            for job in jobs_of_user:
                results.setdefault(key(job), []).append(
                    own.predict(**job, model="tiny", api_name="/run")["output_token_ids"]
                )
        except Exception as e:  # noqa: BLE001 - collected and reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=user, args=(u,)) for u in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert sum(len(v) for v in results.values()) == 48
    for k, outputs in results.items():
        assert all(out == alone[k] for out in outputs), k


def test_explore_runs_on_vllm_through_the_app_and_draws_the_trace(client, fake_vllm):
    """The Explore tab's engine switch: the run goes to a vLLM server started for it (a stand-in
    here, tests/fake_vllm.py) and its trace is drawn by the same views, which say what vLLM does
    not report; the server is kept for the next run until the app's pool is shut down."""
    from conftest import gone

    from mtp_viz.serving import pool
    from mtp_viz.ui.controls import setting_fields

    ui_args = ["the cat", "tiny", "autoregressive", "", 3, 0.0, 0, 1.0, 0, False, "fp32", False, "vllm"]
    ui_args += [f.default for f in setting_fields().values()]
    outputs = client.predict(*ui_args, api_name="/explore_stream")
    tokens, summary = outputs[0], outputs[1]
    assert "vLLM" in summary and "mv-tok" in tokens
    pool.shutdown()
    assert gone(json.loads(fake_vllm.read_text()))


def test_a_page_load_asks_for_no_model_and_only_the_deploy_tab_prices_with_one(tiny_registry, tmp_path, monkeypatch):
    """Every handler the app runs on page load, run as the page runs it, asks the model loader for
    nothing; the tabs' first-open handlers do only where a tab needs models by design (Deploy?
    prices its strategies), with a registry where the shipped results' model loads as in the app."""
    from app_registry import SHIPPED_MODEL, registry_with_shipped_model

    from mtp_viz.errors import UserError
    from mtp_viz.loading import pipeline
    from mtp_viz.ui.app import build_app
    from mtp_viz.ui.deploy_tab import price_results

    monkeypatch.setenv("MTP_VIZ_MODELS", str(registry_with_shipped_model(tiny_registry, tmp_path)))
    monkeypatch.setenv("MTP_VIZ_CACHE", str(tmp_path / "cache"))
    asked = []

    def probe(spec):
        asked.append(spec.name)
        raise UserError("the test's loader loads nothing")  # a model that cannot load: its cost is left blank

    monkeypatch.setattr(pipeline, "load", probe)
    price_results.cache_clear()  # priced by an earlier test: asked for again
    handlers = build_app().fns.values()
    on = {kind: [h for h in handlers if any(event == kind for _, event in h.targets)] for kind in ("load", "select")}
    assert [h.name for h in on["load"]] == ["first_paint"]  # Explore's first look, drawn from its trace
    for handler in on["load"]:
        handler.fn(*[c.value for c in handler.inputs])
    assert asked == []
    for handler in on["select"]:
        handler.fn(*[c.value for c in handler.inputs])
    assert asked and set(asked) == {SHIPPED_MODEL}
