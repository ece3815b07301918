"""``kvctl doctor``'s checks of one engine: its ``/metrics`` (vLLM's series, the KV connector's), its vLLM release.

What the engine's ``/metrics`` says is compared with the connector its configs name (``configured``: ``--config`` or
``--kv-transfer-config``, :func:`kvctl.ops.doctor.connector_of`). LMCache registers its ``lmcache:`` metrics in vLLM's
engine-core process; the API server serves them only under Prometheus multiprocess collection, which vLLM 0.32 sets
up itself only with ``--api-server-count`` > 1 (``vllm/entrypoints/cli/serve.py``:282-283,
``setup_multiprocess_prometheus()``). An engine configured for LMCache whose ``/metrics`` has no ``lmcache:`` series
is a warning with that fix (kvctl's connector carries its ``kvctl:`` series through vLLM's connector-stats path and
needs nothing).
"""

from __future__ import annotations

import json
from typing import Any

from kvctl.connector import metric_names
from kvctl.core.engine_http import EngineHttp, masked
from kvctl.core.errors import KvctlError
from kvctl.diagnose import sources
from kvctl.ops.doctor_host import check_vllm_version
from kvctl.records import prometheus as M
from kvctl.tier.checks import FAIL, OK, WARNING, Check

#: the fix of an LMCache engine whose /metrics lacks LMCache's series (doctor's ``lmcache_metrics``)
MULTIPROC_FIX = ("start the vLLM server with PROMETHEUS_MULTIPROC_DIR pointing at an empty directory it can write "
                 "(e.g. PROMETHEUS_MULTIPROC_DIR=$(mktemp -d) vllm serve ...; a fresh one each start), then check again")


def engine_version(url: str, timeout_s: float, http: EngineHttp | None = None) -> str | None:
    """vLLM's ``GET /version`` (the OpenAI API server's), or None."""
    base = sources.metrics_url(url).rsplit("/metrics", 1)[0]
    try:
        return str(json.loads((http or EngineHttp()).get(base + "/version", timeout_s, accept="application/json").decode()).get("version")) or None
    except (KvctlError, ValueError, AttributeError):
        return None


def engine_checks(raw_url: str, timeout_s: float, configured: str | None, out: list[Check], http: EngineHttp | None = None) -> dict[str, Any]:
    """The engine's lines appended to ``out``; what the rest of doctor needs of it (block size, ranks, connector)."""
    url = masked(raw_url)  # shown and reported; raw_url only for connecting
    try:
        text = sources.fetch_metrics(raw_url, timeout_s, http)
    except KvctlError as e:
        out.append(Check("engine", "metrics", FAIL, str(e), "point --engine-url at the vLLM API server (the port serving /v1/completions); is the engine up?", {"url": url}))
        return {"unreachable": True}
    try:  # parsed as kvctl diagnose parses it (prometheus_client): quoted label values may hold '}' and '"'
        scrape = M.parse(text, url)
    except KvctlError as e:
        out.append(Check("engine", "metrics", FAIL, str(e), "point --engine-url at the vLLM API server, not a sidecar", {"url": url}))
        return {}
    names = set(scrape.values) | set(scrape.buckets)
    if not any(n.startswith(metric_names.VLLM_PREFIX) for n in names):
        out.append(Check("engine", "metrics", FAIL, f"{url} serves /metrics without vllm: series", "point --engine-url at the vLLM API server, not a sidecar", {"url": url}))
        return {}
    out.append(Check("engine", "metrics", OK, f"{sources.metrics_url(url)} answers with vLLM metrics", evidence={"url": url}))
    version = engine_version(raw_url, timeout_s, http)
    if version:
        out.append(check_vllm_version(url, version))  # against the releases proven (kvctl.core.thresholds.VLLM_PROVEN)
    else:
        out.append(Check("engine", "vllm_version", WARNING, f"{url}/version did not answer: vLLM version unknown", "check the engine is vLLM's OpenAI API server", {"url": url}))
    in_metrics = "kvctl" if any(n.startswith(metric_names.PREFIX) for n in names) else "lmcache" if any(n.startswith(metric_names.LMCACHE_PREFIX) for n in names) else None
    connector = in_metrics or configured
    label = {"kvctl": "kvctl (kvctl.plugins.vllm)", "lmcache": "LMCache"}.get(connector or "", connector or "none")
    if connector:
        out.append(Check("engine", "kv_connector", OK, f"KV connector in use: {label}", evidence={"url": url, "connector": connector, "seen_in_metrics": bool(in_metrics)}))
    else:
        out.append(Check(
            "engine", "kv_connector", WARNING, "no KV connector: the engine exports no kvctl: or lmcache: metrics and no --kv-transfer-config names one",
            "start vLLM with --kv-transfer-config (kvctl deploy-valkey vllm-config prints one) to use the remote tier", {"url": url},
        ))
    if configured == "lmcache" and in_metrics is None:
        out.append(Check(
            "engine", "lmcache_metrics", WARNING,
            f"{url}/metrics has no lmcache: series, though the config names LMCache: LMCache registers its metrics in vLLM's engine-core "
            "process, and the API server serves them only under Prometheus multiprocess collection, which vLLM sets up itself only with "
            "--api-server-count > 1; kvctl diagnose and the exporter get no LMCache bytes or read time (no B, no ρ), kvctl report no L2 share",
            MULTIPROC_FIX, {"url": url, "connector": "lmcache"},
        ))
    info = M.labels(text, metric_names.VLLM_CACHE_CONFIG_INFO)
    block = int(info["block_size"]) if info.get("block_size", "").isdigit() else None
    ranks = scrape.gauge(metric_names.RANKS)  # as diagnose reads W
    return {"block_size": block, "ranks": int(ranks) if ranks and ranks >= 1 else None, "connector": connector}
