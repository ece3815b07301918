"""Hostile inputs that used to take unbounded time or memory (issue 21, "Unbounded reads and memory").

Every run is a real kvctl process under an address-space cap (a regression fails with MemoryError
instead of taking the host down) and a deadline; peak memory is the child's own ``ru_maxrss``."""

from __future__ import annotations

import os

import pytest

from tests.hostile.helpers import kvctl

BOMB = """\
a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
"""


# ----------------------------------------------------------------------------- item 10: special files


def test_loading_show_of_a_fifo_is_refused_not_hung(tmp_path):
    fifo = tmp_path / "lm.yaml"
    os.mkfifo(fifo)
    res = kvctl(["loading", "show", "--config", str(fifo)], tmp_path / "home", timeout_s=15)
    assert res.returncode == 2, res.output  # None: it hung on the open or the read
    assert "not a regular file" in res.output


@pytest.mark.parametrize("cmd", [["loading", "async", "--config", "/dev/zero"], ["loading", "show", "--env-file", "/dev/zero"],
                                 ["loading", "show", "--vllm", "/dev/zero"],
                                 ["doctor", "--kv-transfer-config", "@/dev/zero", "--no-host-checks"], ["doctor", "--config", "/dev/zero", "--no-host-checks"]])
def test_dev_zero_as_a_config_is_refused_at_once(tmp_path, cmd):
    res = kvctl(cmd, tmp_path / "home", timeout_s=15)
    assert res.returncode == 2, res.output
    assert "not a regular file" in res.output
    assert res.maxrss_mb < 500, res.maxrss_mb  # the old read grew without bound (6.6 GB in 4 s)


@pytest.mark.parametrize("opt", ["--config", "--env-file", "--vllm"])
def test_an_oversized_config_is_refused_with_the_cap(tmp_path, opt):
    big = tmp_path / "big.yaml"
    big.write_text("# padding\n" * 300_000 + "enable_async_loading: false\n")  # 3 MB
    res = kvctl(["loading", "show", opt, str(big)], tmp_path / "home", timeout_s=15)
    assert res.returncode == 2 and "cap" in res.output, res.output


def test_doctor_kv_transfer_config_file_over_the_cap_is_refused(tmp_path):
    big = tmp_path / "kvt.json"
    big.write_text('{"kv_connector": "KvctlConnector", "pad": "' + "x" * (3 << 20) + '"}')
    res = kvctl(["doctor", "--kv-transfer-config", f"@{big}", "--no-host-checks"], tmp_path / "home", timeout_s=15)
    assert res.returncode == 2 and "cap" in res.output, res.output


# ----------------------------------------------------------------------------- item 11: YAML alias bombs


def test_alias_bomb_in_a_vllm_config_is_refused_quickly(tmp_path):
    """The bomb inside the kv-transfer-config mapping of a ``--vllm`` file: refused with exit 2 and the
    reason, within the deadline and in bounded memory (it took 37 s to a MemoryError at 3 GB)."""
    lines = ["kv-transfer-config:", "  kv_connector: KvctlConnector", "  kv_role: kv_both", "  kv_connector_extra_config:",
             "    async_loading: false"] + ["    " + ln for ln in BOMB.splitlines()]
    f = tmp_path / "vllm.yaml"
    f.write_text("\n".join(lines) + "\n")
    for cmd in (["show"], ["async", "--dry-run"]):
        res = kvctl(["loading", *cmd, "--vllm", str(f)], tmp_path / "home", timeout_s=15)
        assert res.returncode == 2, (cmd, res.returncode, res.output[-500:])
        assert "alias" in res.output
        assert res.maxrss_mb < 500, res.maxrss_mb


def test_alias_bomb_in_an_lmcache_config_is_refused(tmp_path):
    f = tmp_path / "lm.yaml"
    f.write_text("enable_async_loading: false\nextra_config:\n" + "".join("  " + ln + "\n" for ln in BOMB.splitlines()))
    res = kvctl(["loading", "async", "--config", str(f)], tmp_path / "home", timeout_s=15)
    assert res.returncode == 2 and "alias" in res.output, (res.returncode, res.output[-500:])
    assert "enable_async_loading: false" in f.read_text()


def test_self_referencing_alias_is_refused(tmp_path):
    f = tmp_path / "lm.yaml"
    f.write_text("enable_async_loading: false\nloop: &x [1, *x]\n")
    res = kvctl(["loading", "async", "--config", str(f)], tmp_path / "home", timeout_s=15)
    assert res.returncode == 2, res.output


def test_a_few_honest_aliases_still_work(tmp_path):
    f = tmp_path / "lm.yaml"
    f.write_text("base: &base {chunk_size: 256}\nother: *base\nenable_async_loading: false\n")
    res = kvctl(["loading", "async", "--config", str(f)], tmp_path / "home", timeout_s=30)
    assert res.returncode == 0, res.output
    assert "enable_async_loading: true" in f.read_text()


# ----------------------------------------------------------------------------- item 9: simulate sized against memory

SIM = ["simulate", "--arrival-rate", "1000", "--prompt-tokens", "1000", "--bytes-per-token", "48437.5", "--prefill-rate", "52200", "--instance-gbps", "1", "--json"]


@pytest.mark.parametrize("extra", [["--requests", "100000000"], ["--requests", "100000000", "--sweep", "instances=1,2,4"],
                                   ["--requests", "20000000", "--engines", "4"]])
def test_simulate_refuses_what_does_not_fit_with_the_figure(tmp_path, extra):
    """Under a 3 GB address-space limit (``ulimit -v``), 10^8 requests (about 11.5 GB before) or a fleet of
    2·10^7 are refused at once with exit 2 and the figures, not after gigabytes and a MemoryError."""
    res = kvctl([*SIM, *extra], tmp_path / "home", timeout_s=30)
    assert res.returncode == 2, (res.returncode, res.output[-600:])
    assert "GB" in res.output and "--requests" in res.output and "at most about" in res.output
    assert res.maxrss_mb < 400, res.maxrss_mb


def test_simulate_that_fits_still_runs(tmp_path):
    res = kvctl([*SIM, "--requests", "20000"], tmp_path / "home", timeout_s=60)
    assert res.returncode == 0, res.output[-600:]
