"""The Gradio app starts and serves the named `run` endpoint (tiny model via a registry override)."""

import json

import pytest


@pytest.fixture
def served_app(use_tiny_registry):
    from mtp_viz.ui.app import build_app

    app = build_app().queue()
    app.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=None, quiet=True)
    try:
        yield app.local_url
    finally:
        app.close()


def test_run_endpoint_returns_a_trace(served_app):
    from gradio_client import Client

    client = Client(served_app, verbose=False)
    tokens, summary, trace = client.predict(
        "the cat sat on the mat", "tiny", "prompt_lookup", 10, 0.0, 0, api_name="/run"
    )
    assert trace["strategy"] == "prompt_lookup" and trace["model"] == "tiny"
    assert [t["token"] for t in tokens] == [t["text"] for s in trace["steps"] for t in s["emitted"]]
    assert "tokens/s" in summary
    json.dumps(trace)


def test_bad_input_is_a_message_not_a_crash(served_app):
    from gradio_client import Client

    client = Client(served_app, verbose=False)
    with pytest.raises(Exception, match="prompt is empty"):
        client.predict("   ", "tiny", "autoregressive", 10, 0.0, 0, api_name="/run")
    # and the app keeps serving
    _, _, trace = client.predict("a bird", "tiny", "autoregressive", 3, 0.0, 0, api_name="/run")
    assert len(trace["output_token_ids"]) <= 3
