"""`kvctl bench` and the server it measures (issue 45): a GET round trip on Valkey 9.1 and 8.1, the advice to move to
9.1 before adding instances when the measured instance is an 8.x one, and the clients per instance following the
io-threads of a `--dir` tier. Real valkey-servers, real bench client processes."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.tier.sizing import io_threads_for
from tests.tier.helpers import free_base_port
from tests.tier.servers import valkey_8, valkey_binary  # noqa: F401 - the fixture

MB = 10**6


def _bench(*args: str) -> dict:
    res = CliRunner().invoke(cli, ["bench", "--chunk-bytes", "1e6", "--batch", "4", "--keys", "16", "--duration", "0.5", "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_get_round_trip_and_the_advice_on_both_servers(valkey_binary, valkey_factory):
    """9.1 with the io-threads `deploy-valkey up` gives this host: no advice. 8.1 (at most 3.11 GB/s an instance even on
    a 16-core host, against 4.80 for 9.1 at one thread): move to 9.1 first, also in the verdict when recompute wins,
    before "add instances"."""
    threads = io_threads_for(None, 1)
    v = valkey_factory(settings={"maxmemory": "128mb", "io-threads": threads}, binary=valkey_binary)
    # R far above anything loopback serves: recompute wins, and the verdict says what to do
    data = _bench("--valkey", v.url, "--prefill-rate", "1e9", "--bytes-per-token", "1e6")
    (run,) = data["runs"]
    assert run["op"] == "get" and run["aggregate_gbps"] > 0 and run["ops"] > 0 and run["misses"] == 0
    version = data["metadata"]["server_versions"][0]
    verdict = data["verdict"]["text"]
    assert not data["verdict"]["loading_wins"] and "add instances" in verdict
    if valkey_binary == valkey_8():
        assert version.startswith("8.1") and data["advice"].startswith(f"Valkey {version}: move to 9.1"), data["advice"]
        assert verdict.index(f"first Valkey {version}: move to 9.1") < verdict.index("add instances"), verdict
    else:
        assert version.startswith("9.1") and data["advice"] is None and "move to" not in verdict


def test_clients_per_instance_follow_the_io_threads_of_a_dir_tier(tmp_path):
    d = tmp_path / "tier"
    res = CliRunner().invoke(cli, ["deploy-valkey", "up", "--ranks", "1", "--io-threads", "3", "--maxmemory", "128mb",
                                   "--base-port", str(free_base_port(1)), "--dir", str(d)])
    assert res.exit_code == 0, res.output
    try:
        (run,) = _bench("--dir", str(d))["runs"]
        assert run["clients"] == 3  # one per I/O thread, as many connections as vllm-config writes
        (run,) = _bench("--dir", str(d), "--clients", "1")["runs"]
        assert run["clients"] == 1  # --clients wins
    finally:
        assert CliRunner().invoke(cli, ["deploy-valkey", "down", "--dir", str(d)]).exit_code == 0
