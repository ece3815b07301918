"""Issue 48 item 7: kvctl picks free loopback ports wherever it starts servers locally, unless a port is given.

`deploy-valkey up` took 17400.. (a fixed base port) unless told otherwise, so the README's sizing rehearsal failed word
for word on a host where another tier held 17400. Now a local `up` without --base-port (or KVCTL_BASE_PORT) takes
17400.. when those ports are free and a run of free loopback ports otherwise; a port given is kept, and refused when
taken. The ports are held by real listening sockets (tests/held_ports.py).
"""

from __future__ import annotations

import json

from kvctl.tier.state_file import load_tier
from tests.held_ports import held_ports
from tests.tier.helpers import invoke


def test_up_takes_free_ports_when_the_default_ones_are_busy(tmp_path, monkeypatch):
    monkeypatch.delenv("KVCTL_BASE_PORT", raising=False)
    d = tmp_path / "kv-tier"
    with held_ports() as busy:
        res = invoke("up", "--ranks", "2", "--maxmemory", "64mb", "--dir", str(d), "--json")
        try:
            assert res.exit_code == 0, res.output
            ports = [i.port for i in load_tier(d).instances]
            assert len(ports) == 2 and not set(ports) & set(busy), (ports, busy)
            assert ports[1] == ports[0] + 1  # rank r on base + r, as documented
            st = invoke("status", "--dir", str(d), "--json")
            assert st.exit_code == 0, st.output
        finally:
            invoke("down", "--dir", str(d))


def test_a_port_given_is_kept_and_refused_when_busy(tmp_path, monkeypatch):
    monkeypatch.delenv("KVCTL_BASE_PORT", raising=False)
    with held_ports() as busy:
        res = invoke("up", "--ranks", "1", "--maxmemory", "64mb", "--base-port", str(busy[0]), "--dir", str(tmp_path / "a"))
        assert res.exit_code != 0 and f"{busy[0]} is already in use" in res.output, res.output
        assert not (tmp_path / "a").exists()  # nothing started, nothing left
        monkeypatch.setenv("KVCTL_BASE_PORT", str(busy[1]))  # the env var is a port given too
        res = invoke("up", "--ranks", "1", "--maxmemory", "64mb", "--dir", str(tmp_path / "b"))
        assert res.exit_code != 0 and f"{busy[1]} is already in use" in res.output, res.output


def test_help_says_the_default_is_free_ports():
    text = " ".join(invoke("up", "--help").output.split())
    assert "free loopback ports" in text and "KVCTL_BASE_PORT" in text, text


def test_systemd_renders_keep_the_fixed_base_port(tmp_path, monkeypatch):
    """A rendered fleet runs on other hosts: its ports are not this host's to pick, 17400 stays their default."""
    monkeypatch.delenv("KVCTL_BASE_PORT", raising=False)
    with held_ports():
        res = invoke("up", "--target", "systemd", "--ranks", "2", "--out", str(tmp_path / "out"), "--json")
    assert res.exit_code == 0, res.output
    assert "17400" in json.dumps(json.loads(res.stdout)) or "17400" in (tmp_path / "out").joinpath(
        next(p.name for p in (tmp_path / "out").iterdir() if p.suffix == ".conf" or "valkey" in p.name)).read_text()


def test_drill_engine_on_a_free_port_keeps_it_across_a_restart(tmp_path, valkey_server):
    """The drill starts its engine on port 0 (the engine binds a free one and prints it: no port to race for); a SIGHUP
    restart (the async-fix drill's) keeps that port, as the replay sending to it needs (it used to take a new one)."""
    import subprocess
    import sys

    from kvctl.drill.config import EngineSettings, write_config

    cfg = write_config(tmp_path / "engine.yaml", EngineSettings(remote_urls=[valkey_server.url], chunk_bytes=4096, prefill_tokens_per_s=1e6,
                                                                t0_s=0.0, stream_bytes_per_s=1e9))
    proc = subprocess.Popen([sys.executable, "-m", "kvctl.drill.engine", "--config", str(cfg), "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        assert first.startswith("PORT ") and int(first.split()[1]) > 0, first
        proc.stdout.readline()
        proc.send_signal(1)  # SIGHUP
        assert proc.stdout.readline() == first
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_run_of_free_ports_is_picked_below_the_ephemeral_range(tmp_path):
    """The kernel gives outgoing connections source ports from its ephemeral range: a tier's run picked there could
    lose a port to one before its server binds it. Picked runs are free, and below that range when there is room."""
    from kvctl.tier.local import pick_base_port
    from kvctl.tier.server import LOW_PORT, candidate_base_port, ephemeral_ports, free_base_port, port_in_use

    lo, hi = ephemeral_ports()
    room = lo - 8 > LOW_PORT  # a host whose ephemeral range starts low gets the kernel's offer instead
    for base in [free_base_port(8) for _ in range(5)] + [pick_base_port(8, preferred=None) for _ in range(5)]:
        assert not any(port_in_use(base + i) for i in range(8)), base
        assert not room or LOW_PORT <= base and base + 8 <= lo, (base, lo)
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ephemeral_ports(str(f)) == (40000, 50000)
    for bad in ("", "x y", "50000 40000", "0 10"):
        f.write_text(bad)
        assert ephemeral_ports(str(f)) == (32768, 60999)
    assert ephemeral_ports(str(tmp_path / "missing")) == (32768, 60999)
    assert not room or LOW_PORT <= candidate_base_port(8) < lo
