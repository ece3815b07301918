"""KvctlConnector is in vLLM's connector registry once its module is imported (MultiConnector's stats need it).

Each check runs in a fresh interpreter: vLLM's registry is process-wide, and the
process that logs stats imports kvctl only through ``kv_connector_module_path``.
The whole engine path (MultiConnector with stats logging on, serving a tier hit)
is tests/engine/test_kvctl_keys.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.engine


def run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_multiconnector_rebuilds_kvctl_stats_as_the_stats_logger_does():
    """What vLLM's stat loggers do in the API-server process: load the children's classes through the factory
    (build_prom_metrics), then rebuild the serialised per-child stats (KVConnectorLogging.observe)."""
    out = run("""
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
cls = KVConnectorFactory.get_connector_class(KVTransferConfig(
    kv_connector="KvctlConnector", kv_connector_module_path="kvctl.plugins.vllm", kv_role="kv_both"))
stats = MultiConnector.build_kv_connector_stats(data={"KvctlConnector": {"kvctl:chunks_hit": 3}})
child = stats["KvctlConnector"]
print(type(child).__name__, child.reduce(), cls is KVConnectorFactory.get_connector_class_by_name("KvctlConnector"))
""")
    assert out == "KvctlConnectorStats {'chunks_hit': 3} True"


def test_registration_is_idempotent_and_module_path_loading_still_works():
    out = run("""
import importlib
import kvctl.plugins.vllm as m
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
again = m.register_with_vllm()
m = importlib.reload(m)  # a second import of the module must not raise "already registered"
by_path = KVConnectorFactory.get_connector_class(KVTransferConfig(
    kv_connector="KvctlConnector", kv_connector_module_path="kvctl.plugins.vllm", kv_role="kv_both"))
by_name = KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector="KvctlConnector", kv_role="kv_both"))
print(again, by_path.__module__, by_name.__module__, by_path.__name__ == by_name.__name__ == "KvctlConnector")
""")
    assert out == "False kvctl.plugins.vllm kvctl.plugins.vllm True"
