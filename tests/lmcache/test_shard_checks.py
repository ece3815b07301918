"""Shard mode's start-up checks: LMCache 0.5.6 only, and the configs it refuses (kvctl.plugins.lmcache_shard)."""

from __future__ import annotations

import subprocess

import pytest

from kvctl.plugins.lmcache_shard import PINNED_LMCACHE_VERSION, ShardModeError, check_lmcache_version
from tests.lmcache.lmcache_env import REPO, run_scenario

CHECK = "from kvctl.plugins.lmcache_shard import check_lmcache_version; print(check_lmcache_version())"


@pytest.mark.parametrize("version", ["0.5.7", "0.5.5", "0.6.0", "0.5.6.post1"])
def test_other_versions_refused_with_the_reason(version):
    with pytest.raises(ShardModeError) as exc:
        check_lmcache_version(version)
    msg = str(exc.value)
    assert f"LMCache {version}" in msg and "lmcache==0.5.6" in msg and "kvctl_shard" in msg


def test_pinned_version_accepted():
    assert PINNED_LMCACHE_VERSION == "0.5.6" and check_lmcache_version("0.5.6") == "0.5.6"


def test_installed_version_read_from_package_metadata(lmc_python, tmp_path):  # noqa: F811
    """The LMCache venv passes; the same venv with a 0.5.7 distribution first on the path is refused at start-up."""
    ok = subprocess.run([lmc_python, "-c", CHECK], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert ok.returncode == 0 and ok.stdout.strip() == "0.5.6", ok.stderr[-2000:]
    fake = tmp_path / "site"
    dist = fake / "lmcache-0.5.7.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: lmcache\nVersion: 0.5.7\n")
    bad = subprocess.run([lmc_python, "-c", CHECK], capture_output=True, text=True, timeout=120, cwd=REPO,
                         env={"PYTHONPATH": str(fake), "PATH": "/usr/bin:/bin"})
    assert bad.returncode != 0
    assert "ShardModeError" in bad.stderr and "this engine has LMCache 0.5.7" in bad.stderr


def test_prepare_config_on_lmcache_config(lmc_python):  # noqa: F811
    out = run_scenario("shard_prepare", {})
    ok = out["ok"]
    # every rank active, a lookup server on each of the 2 ranks (stock MLA: rank 0 only), other extra keys kept
    assert ok["extra_config"] == {"keep": 1, "save_only_first_rank": False, "remote_enable_mla_worker_id_as0": False}
    assert ok["lookup_server_worker_ids"] == [0, 1] and ok["mla_lookup_servers"] == [0, 1]
    assert out["async"]["lookup_server_worker_ids"] == [0, 1]  # async loading: the cumulative-length lookup
    assert "use_layerwise" in out["layerwise"]
    assert "save_unfull_chunk" in out["unfull"]
    assert "for MLA models" in out["gqa"]
    assert "pipeline_parallel_size 2" in out["pipeline"]
    assert "sparse-attention indexer" in out["sparse"] and "KvctlConnector" in out["sparse"]  # issue 34
