"""The Gradio app against a launched server (tiny models via a registry override): the named `run` and
`compare` endpoints through gradio_client, bad input as messages, the app still serving after."""

import pytest

from mtp_viz.trace import SCHEMA_VERSION


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
    assert trace["settings"]["num_draft_tokens"] == 10


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
