"""`kvctl loading sync` refuses when the diagnosis cannot decide (issue 12, item 8), unless --force.

Real files, the real command; the diagnoses are `kvctl diagnose --json` objects
(written here with the fields that command emits) or the one a live
`kvctl diagnose` saves under KVCTL_HOME.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
import time

import pytest
import yaml
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.diagnose.capture import save_last_diagnosis
from tests.diagnose.engine_text import EngineState
from tests.diagnose.metrics_server import MetricsServer

CONFIG = "chunk_size: 256\nremote_url: \"resp://valkey-{rank}:6379\"\nenable_async_loading: true  # ops\n"


def now(minus_s: float = 0.0) -> str:
    return (dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=minus_s)).replace(microsecond=0).isoformat()


def good(**over) -> dict:
    d = {"rho": 0.3, "rho_bound": "estimate", "bandwidth_source": "kvctl_connector", "created_at": now(60), "findings": []}
    d.update(over)
    return d


@pytest.fixture
def config(tmp_path, monkeypatch):
    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)
    p = tmp_path / "lmcache.yaml"
    p.write_text(CONFIG)
    return p


def sync(config, *args):
    return CliRunner().invoke(cli, ["loading", "sync", "--config", str(config), *args])


def test_no_diagnosis_is_refused_and_force_goes_through(config):
    res = sync(config)
    assert res.exit_code == 1 and "no diagnosis found" in res.stderr and "--force" in res.stderr
    assert config.read_text() == CONFIG
    res = sync(config, "--force")
    assert res.exit_code == 0, res.output
    assert yaml.safe_load(config.read_text())["enable_async_loading"] is False
    assert "forced" in res.stderr


@pytest.mark.parametrize(
    "diag, words",
    [
        (good(rho=None, null_reasons={"rho": "no GET timing in the window"}), "no usable ρ (ρ is null: no GET timing in the window)"),
        (good(rho="0.2"), 'no usable ρ (ρ is "0.2", a string'),
        (good(rho=True), "no usable ρ (ρ is true"),
        (good(rho=0.3, rho_bound="lower_bound", bandwidth_source="valkey_server_upper_bound"), "only a lower bound"),
        (good(rho=0.3, created_at="2020-01-01T00:00:00+00:00"), "h old"),
        (good(rho=0.3, created_at=None), "undated"),
        (good(rho=0.3, created_at="last tuesday"), "not an ISO time"),
        (good(rho=0.3, created_at=now(-7200)), "in the future"),
        (good(rho=0.93), "ρ = 0.93 ≥ 0.7"),
    ],
)
def test_undecidable_or_unsafe_diagnosis_file_is_refused(config, tmp_path, diag, words):
    f = tmp_path / "diag.json"
    f.write_text(json.dumps(diag))
    res = sync(config, "--diagnosis", str(f))
    assert res.exit_code == 1, res.output
    assert "refusing to switch to synchronous loading" in res.stderr and words in " ".join(res.stderr.split())
    assert "None" not in res.stderr and "True" not in res.stderr  # issue 22: no Python None in messages
    assert config.read_text() == CONFIG
    assert sync(config, "--diagnosis", str(f), "--force").exit_code == 0


def test_nan_rho_in_the_file_is_refused(config, tmp_path):
    f = tmp_path / "diag.json"
    f.write_text('{"rho": NaN, "rho_bound": "estimate", "created_at": "%s"}' % now(10))  # Python's json writes this
    res = sync(config, "--diagnosis", str(f))
    assert res.exit_code == 1 and "no usable ρ (ρ is NaN" in res.stderr


def test_fresh_engine_side_rho_below_threshold_is_allowed(config, tmp_path):
    f = tmp_path / "diag.json"
    f.write_text(json.dumps(good(rho=0.3)))
    res = sync(config, "--diagnosis", str(f), "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["safety"]["rho"] == 0.3 and out["safety"]["note"].startswith("ρ = 0.30 < 0.7")


def test_max_age_option(config, tmp_path):
    f = tmp_path / "diag.json"
    f.write_text(json.dumps(good(created_at=now(2 * 3600))))  # two hours old
    assert sync(config, "--diagnosis", str(f)).exit_code == 1
    assert sync(config, "--diagnosis", str(f), "--max-age", "3h", "--dry-run").exit_code == 0
    bad = sync(config, "--diagnosis", str(f), "--max-age", "nan")
    assert bad.exit_code == 2 and "--max-age" in bad.output


def test_last_saved_live_diagnosis_with_server_side_b_is_a_lower_bound_and_refused(config, valkey_factory):
    """A live `kvctl diagnose` with only Valkey's server-side timing: the saved ρ is a lower bound. (Valkey 8.1: 9.x's
    GET time leaves the copy of the value out and bounds nothing, so diagnose takes no B from it.)"""
    import redis  # noqa: PLC0415

    from tests.tier.servers import valkey_8  # noqa: PLC0415

    valkey_server = valkey_factory(binary=valkey_8())

    r = redis.Redis(port=valkey_server.port)
    r.set("chunk", b"x" * 100_000)
    before = EngineState(running=1, lmcache=False)
    after = before.advance(requests=50, prompt_lengths=[1000] * 50, running=1)

    def load() -> None:  # the engine "loads" 50 chunks in the middle of the 1 s window
        time.sleep(0.4)
        for _ in range(50):
            r.get("chunk")

    class Texts:
        n = 0

        def __call__(self) -> str:
            self.n += 1
            if self.n == 1:
                threading.Thread(target=load, daemon=True).start()
            return (before if self.n == 1 else after).text()

    with MetricsServer(Texts()) as srv:
        res = CliRunner().invoke(cli, ["diagnose", "--engine-url", srv.url, "--valkey", valkey_server.url, "--window", "1", "--json"])
    assert res.exit_code in (0, 3, 4), res.output
    assert json.loads(res.stdout)["rho_bound"] == "lower_bound"
    config.write_text(f"chunk_size: 256\nremote_url: \"{valkey_server.url}\"\nenable_async_loading: true  # ops\n")  # the tier diagnosed
    res = sync(config)
    assert res.exit_code == 1 and "only a lower bound" in res.stderr
    save_last_diagnosis(good(rho=0.3, instances=[{"url": valkey_server.url}]))  # a diagnosis is its tier's (issue 48)
    assert sync(config).exit_code == 0
