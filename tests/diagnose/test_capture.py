"""Saving and loading captures: what goes to disk, what is refused on the way back.

Pure file round-trips on tmp_path (no servers): the capture format is a
directory of text/JSON files that ``kvctl diagnose --from`` must read back
exactly as the live run saw it.
"""

from __future__ import annotations

import json

import pytest

from kvctl.diagnose.capture import CAPTURE_FILE, Capture, Sample, load_capture, save_capture, wait_until
from kvctl.diagnose.sources import GpuSample
from kvctl.core.errors import InvalidInput

INFO_A = {"cmdstat_get": {"calls": 10, "usec": 500}, "total_net_output_bytes": 1000}
INFO_B = {"cmdstat_get": {"calls": 30, "usec": 1500}, "total_net_output_bytes": 5000}


def _cap(valkey_urls: list[str]) -> Capture:
    n = len(valkey_urls)
    g = GpuSample([40.0], ["H200"])
    a = Sample(100.0, ["vllm:x 1\n"], [INFO_A] * n, g, engine_t_s=[100.25], valkey_t_s=[100.5] * n)
    b = Sample(110.0, ["vllm:x 2\n"], [INFO_B] * n, g, engine_t_s=[110.25], valkey_t_s=[110.5] * n)
    return Capture(["http://engine:8000"], valkey_urls, [a, b], {"bytes_per_token": 48437.5}, "2026-11-30T00:00:00+00:00")


def test_passwords_never_reach_disk(tmp_path):
    urls = ["resp://:s3cret@10.0.0.1:6379", "redis://kvctl-engine:hunter2@10.0.0.2:6380/1", "resp://10.0.0.3:6381", "http://u:topsecret@h:1"]
    out = save_capture(_cap(urls), tmp_path / "cap")
    text = "".join(p.read_text() for p in out.rglob("*") if p.is_file())
    assert "s3cret" not in text and "hunter2" not in text and "topsecret" not in text
    stored = json.loads((out / CAPTURE_FILE).read_text())["valkey_urls"]
    # host, port, user and db survive; only the password is masked
    assert "10.0.0.1:6379" in stored[0] and ":***@" in stored[0]
    assert "kvctl-engine:***@10.0.0.2:6380/1" in stored[1]
    assert stored[2] == "resp://10.0.0.3:6381"  # no password: as given, so --from shows what the live run showed


def test_round_trip_keeps_every_sample_time_and_source(tmp_path):
    cap = _cap(["resp://10.0.0.3:6381"])
    cap.samples[1].engines = [None]  # the engine did not answer the second read
    cap.samples[1].engine_errors = ["timed out after 5 s"]
    back = load_capture(save_capture(cap, tmp_path / "cap"))
    assert back.engine_urls == ["http://engine:8000"] and back.parameters == {"bytes_per_token": 48437.5}
    a, b = back.samples
    assert (a.t_s, b.t_s) == (100.0, 110.0)
    assert (a.engine_time(0), a.valkey_time(0), b.valkey_time(0)) == (100.25, 100.5, 110.5)
    assert a.engines == ["vllm:x 1\n"] and b.engines == [None] and b.engine_error(0) == "timed out after 5 s"
    assert a.valkey == [INFO_A] and b.valkey == [INFO_B]
    assert b.gpu.utilization_pct == [40.0]


def test_refuses_to_overwrite_a_capture(tmp_path):
    save_capture(_cap([]), tmp_path / "cap")
    with pytest.raises(InvalidInput, match="already holds a capture"):
        save_capture(_cap([]), tmp_path / "cap")


def _saved_meta(tmp_path):
    out = save_capture(_cap(["resp://10.0.0.3:6381"]), tmp_path / "cap")
    return out, json.loads((out / CAPTURE_FILE).read_text())


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.update(format=99), "upgrade kvctl"),
        (lambda m: m.update(format=True), "format True"),
        (lambda m: m["samples"][0].update(engines=["../../etc/passwd"]), "outside the capture directory"),
        (lambda m: m["samples"][0].update(t_s="nan"), "not a finite time"),
        (lambda m: m.update(samples=m["samples"][:1]), "1 sample"),
        (lambda m: m.pop("samples"), "incomplete or corrupt"),
    ],
)
def test_load_refuses_a_bad_capture_with_its_reason(tmp_path, edit, message):
    out, meta = _saved_meta(tmp_path)
    edit(meta)
    (out / CAPTURE_FILE).write_text(json.dumps(meta))
    with pytest.raises(InvalidInput, match=message):
        load_capture(out)


def test_load_names_a_missing_or_unreadable_capture(tmp_path):
    with pytest.raises(InvalidInput, match="holds no capture"):
        load_capture(tmp_path)
    (tmp_path / CAPTURE_FILE).write_text("[1, 2]")
    with pytest.raises(InvalidInput, match="not a JSON object"):
        load_capture(tmp_path)


@pytest.mark.parametrize("deadline", [float("nan"), 1e18])
def test_wait_until_refuses_absurd_deadlines(deadline):
    with pytest.raises(InvalidInput, match="refusing to wait"):
        wait_until(deadline)


def test_live_diagnosis_never_prints_or_keeps_a_password(tmp_path):
    """`kvctl diagnose --valkey resp://:PW@host --json` against a real passworded Valkey: the password
    reaches neither stdout nor last-diagnosis.json nor the saved capture, and --from shows the same URLs."""
    from click.testing import CliRunner

    from kvctl.cli import cli
    from kvctl.diagnose.capture import last_diagnosis_path
    from kvctl.tier.server import start_valkey
    from tests.diagnose.engine_text import EngineState
    from tests.diagnose.metrics_server import MetricsServer

    before = EngineState()
    after = before.advance(requests=10, prompt_lengths=[16000] * 10, remote_read_bytes=1e9, remote_get_ms=[1] * 10)
    with start_valkey(tmp_path / "v", password="s3cretpw") as v, MetricsServer([before.text(), after.text()]) as srv:
        url = f"resp://:s3cretpw@127.0.0.1:{v.port}"
        res = CliRunner().invoke(cli, ["diagnose", "--engine-url", srv.url, "--valkey", url, "--window", "0.3", "--json", "--save", str(tmp_path / "cap")])
    assert res.exit_code == 0, res.output
    live = json.loads(res.stdout)
    assert live["instances"][0]["status"] == "ok"  # it did log in
    assert "s3cretpw" not in res.output and "s3cretpw" not in last_diagnosis_path().read_text()
    assert live["instances"][0]["url"] == f"resp://:***@127.0.0.1:{v.port}/0"
    replay = CliRunner().invoke(cli, ["diagnose", "--from", str(tmp_path / "cap"), "--json"])
    assert json.loads(replay.stdout)["instances"] == live["instances"]
    with start_valkey(tmp_path / "w", password="s3cretpw") as v, MetricsServer([before.text(), after.text()]) as srv:
        url = f"resp://:s3cretpw@127.0.0.1:{v.port}"
        res = CliRunner().invoke(cli, ["diagnose", "--engine-url", srv.url, "--valkey", url, "--window", "0.3", "--watch", "--count", "1", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["instances"][0]["url"] == f"resp://:***@127.0.0.1:{v.port}/0"
    assert "s3cretpw" not in res.output and "s3cretpw" not in last_diagnosis_path().read_text()


def test_saves_never_share_a_fixed_temp_name(tmp_path, monkeypatch):
    """Two `diagnose --watch` runs used to write through the same `last-diagnosis.json.tmp` (and a capture
    through `capture.json.tmp`): one run's temp file in the way broke the other. Every write now goes
    through kvctl.core.files.write_atomic (a unique temp name, fsync, rename), so the other run's temp name is
    no obstacle; here a directory stands where the old fixed temp names were."""
    from kvctl.diagnose.capture import LAST_DIAGNOSIS, save_last_diagnosis

    monkeypatch.setenv("KVCTL_HOME", str(tmp_path / "home"))
    (tmp_path / "home" / (LAST_DIAGNOSIS + ".tmp")).mkdir(parents=True)  # old: path.with_suffix(".json.tmp")
    path = save_last_diagnosis({"rho": 0.5})
    assert json.loads(path.read_text()) == {"rho": 0.5}
    out = tmp_path / "cap"
    (out / (CAPTURE_FILE + ".tmp")).mkdir(parents=True)
    assert load_capture(save_capture(_cap([]), out)).parameters == {"bytes_per_token": 48437.5}
    # and nothing of ours is left behind: only the obstacles, the files and the sample folders
    assert not [p for p in tmp_path.rglob("*.kvctl-tmp")]
