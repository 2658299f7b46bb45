"""Serving engines behind the same trace: a vLLM server, started in its own virtual environment
and talked to over HTTP only (`server`), the strategy → vLLM method mapping (`methods`), its
responses as traces (`traces`), and speed under concurrent load (`load`)."""
