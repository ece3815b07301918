"""KvctlConnector is a thin facade, as vLLM's own OffloadingConnector is (issue 49 item 3): it builds one frozen spec
from vLLM's config and one half by role, a scheduler side or a worker side, plain objects that share the spec and
not ``self``; each vLLM method the facade answers is one forward to that half.

Both roles on a real Valkey instance; the worker around real paged caches on a one-rank gloo group.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole  # noqa: E402

pytestmark = pytest.mark.engine

FACADE = Path(__file__).resolve().parents[2] / "plugins" / "vllm.py"
#: what the facade itself holds: vLLM's base class fields, the spec, the counters and trace, the two halves
FACADE_STATE = {"_role", "_connector_metadata", "_vllm_config", "_kv_transfer_config", "_kv_cache_config",
                "_kv_cache_manager", "spec", "stats", "trace", "scheduler", "worker"}


def connector(url, role):
    from kvctl.plugins.vllm import KvctlConnector

    kw = {}
    if role == KVConnectorRole.WORKER:
        kw = {"kv_caches": {n: torch.zeros(8, 2, 6) for n in ("l0", "l1")},
              "coordinator": SimpleNamespace(rank_in_group=0, world_size=1, cpu_group=None, ranks=[0])}
    return KvctlConnector.without_engine(
        {"urls": [url], "chunk_tokens": 4, "timeout_s": 2.0}, world_size=1, layer_names=["l0", "l1"],
        spec=SimpleNamespace(head_size=6, num_kv_heads=1, dtype=torch.float32), block_size=2, use_mla=True,
        model_name="m", role=role, **kw)


def test_the_facade_builds_one_half_by_role_from_one_frozen_spec(gloo_world1, valkey_server):
    from kvctl.plugins.vllm import KvctlConnector
    from kvctl.plugins.vllm_scheduler import SchedulerSide
    from kvctl.plugins.vllm_spec import ConnectorSpec
    from kvctl.plugins.vllm_worker import WorkerSide

    assert KvctlConnector.__bases__ == (KVConnectorBase_V1,)  # no mixins
    assert SchedulerSide.__bases__ == (object,) and WorkerSide.__bases__ == (object,)
    sched = connector(valkey_server.url, KVConnectorRole.SCHEDULER)
    worker = connector(valkey_server.url, KVConnectorRole.WORKER)
    try:
        assert isinstance(sched.spec, ConnectorSpec) and sched.spec == worker.spec  # the same spec on both roles
        with pytest.raises(dataclasses.FrozenInstanceError):
            sched.spec.fmt = "other"
        assert isinstance(sched.scheduler, SchedulerSide) and sched.worker is None
        assert isinstance(worker.worker, WorkerSide) and worker.scheduler is None
        assert sched.scheduler.spec is sched.spec and worker.worker.spec is worker.spec
        assert sched.scheduler.stats is sched.stats and worker.worker.trace is worker.trace
        # the halves' state is their own: the facade holds none of it
        assert set(vars(sched)) <= FACADE_STATE and set(vars(worker)) <= FACADE_STATE, (vars(sched), vars(worker))
        # and no half reaches back into the facade (a mixin's ``self`` was the connector)
        assert all(v is not sched for v in vars(sched.scheduler).values())
        assert all(v is not worker for v in vars(worker.worker).values())
        assert worker.worker.store is not None and worker.worker.layout.fmt(1) == worker.spec.fmt
    finally:
        sched.shutdown()
        worker.shutdown()


def test_each_vllm_method_of_the_facade_is_one_forward_and_the_facade_stays_small():
    text = FACADE.read_text()
    assert len(text.splitlines()) <= 250
    cls = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "KvctlConnector")
    builders = {"__init__", "without_engine", "_build", "bind_connector_metadata"}
    long = []
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef) or fn.name in builders:
            continue
        body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        if len(body) != 1:
            long.append(fn.name)
    assert long == []


def _vllm_config(extra: dict, *, pcp: int = 1, served=None, async_scheduling: bool = False, v2: bool = False):
    """The parts of vLLM's config KvctlConnector reads, for one scheduler built outside an engine."""
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, prefill_context_parallel_size=pcp,
                                        pipeline_parallel_size=1),
        cache_config=SimpleNamespace(block_size=2, cache_dtype="auto"),
        model_config=SimpleNamespace(use_mla=True, served_model_name=served, model="/models/m"),
        scheduler_config=SimpleNamespace(async_scheduling=async_scheduling), shutdown_timeout=30,
        use_v2_model_runner=v2)


def test_an_engine_builds_the_spec_from_vllms_config_as_without_engine_does_from_its_parts(valkey_server):
    """The path vLLM takes (``KvctlConnector(vllm_config, role, kv_cache_config)``) and the one tests and
    benchmarks take (``without_engine``) come to the same spec: the shard group, block size, served name, cache
    dtype, async scheduling."""
    from kvctl.plugins.vllm import KvctlConnector
    from kvctl.plugins.vllm_spec import stand_in_config

    extra = {"urls": [valkey_server.url, valkey_server.url], "chunk_tokens": 4, "timeout_s": 2.0}
    spec = SimpleNamespace(head_size=6, num_kv_heads=1, dtype=torch.float32)
    kv_cache_config = stand_in_config(["l0", "l1"], spec)
    vllm_config = _vllm_config(extra, pcp=2, served=["served", "other"], async_scheduling=True)
    engine = KvctlConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    alone = KvctlConnector.without_engine(extra, world_size=2, layer_names=["l0", "l1"], spec=spec, block_size=2,
                                          use_mla=True, model_name="served", group_kind="pcp",
                                          role=KVConnectorRole.SCHEDULER, kv_cache_config=kv_cache_config)
    try:
        assert engine.spec.async_scheduling and not alone.spec.async_scheduling  # only an engine has a scheduler config
        assert engine.spec == dataclasses.replace(alone.spec, async_scheduling=True)
        assert (engine.spec.group_kind, engine.spec.world_size, engine.spec.model_name) == ("pcp", 2, "served")
        # sync_load_path auto follows vLLM's async scheduling onto the remote-receive path
        assert engine.scheduler.sync_via_receive and not alone.scheduler.sync_via_receive
        assert set(vars(engine)) <= FACADE_STATE, vars(engine)
    finally:
        engine.shutdown()
        alone.shutdown()


def test_model_runner_v2_sends_sync_loads_through_the_receive_path(valkey_server):
    """vLLM 0.32's Model Runner V2 (its default on CUDA) rewinds a request whose step-path load came up short on
    the host only and computes the recompute from a stale position on the GPU (vllm#49250): on the H100 on
    2026-12-05 the layered fault run's reader (async scheduling off, so the step path) ended its engine core at the
    chunk deleted between lookup and load. With ``sync_load_path`` auto a V2 engine takes the receive path, with
    async scheduling off as well; V1 keeps the step path; ``step`` keeps it anyway and warns, and ``layer_groups``
    > 1 on the receive path says the overlap is off."""
    import logging

    from kvctl.plugins.vllm import KvctlConnector
    from kvctl.plugins.vllm_spec import stand_in_config

    spec = SimpleNamespace(head_size=6, num_kv_heads=1, dtype=torch.float32)
    kv_cache_config = stand_in_config(["l0", "l1"], spec)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("vllm.kvctl.plugins.vllm")
    level = logger.level
    logger.setLevel(logging.INFO)  # the receive path's line is INFO: vLLM's own setup may have left WARNING
    logger.addHandler(handler)

    def engine(v2: bool, **extra):
        cfg = {"urls": [valkey_server.url], "chunk_tokens": 4, "timeout_s": 2.0, **extra}
        lines.clear()
        c = KvctlConnector(_vllm_config(cfg, v2=v2), KVConnectorRole.SCHEDULER, kv_cache_config)
        c.shutdown()
        return c.spec, c.scheduler.sync_via_receive, list(lines)

    try:
        v2_spec, v2_receive, v2_log = engine(True)
        v1_spec, v1_receive, _ = engine(False)
        assert (v2_spec.v2_runner, v2_receive) == (True, True) and (v1_spec.v2_runner, v1_receive) == (False, False)
        assert any("Model Runner V2" in ln and "remote-receive" in ln for ln in v2_log), v2_log
        _, forced, forced_log = engine(True, sync_load_path="step")
        assert not forced and any("vllm#49250" in ln and "sync_load_path=step" in ln for ln in forced_log), forced_log
        _, layered, layered_log = engine(True, layer_groups=2)
        assert layered and any("layer_groups=2" in ln and "sync_load_path: step" in ln for ln in layered_log), layered_log
        _, _, v1_layered_log = engine(False, layer_groups=2)
        assert not any("layer_groups=2" in ln for ln in v1_layered_log), v1_layered_log
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
