"""What ``kvctl bench`` advises when it refuses a run: only options that go with the ones given (issue 30,
item 14). ``--engines`` sets the clients per instance itself and refuses ``--clients``, so the advice for
an --engines bench names --engines, never --clients. Refused before any server starts."""

from __future__ import annotations

import os

from click.testing import CliRunner

from kvctl.bench.spec import MAX_CLIENTS_PER_CORE, MIN_CLIENT_CAP
from kvctl.cli import cli


def _bench(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(cli, ["bench", *args, "--duration", "0.5"])
    return r.exit_code, " ".join(r.output.split())


def test_too_many_engine_clients_advise_fewer_engines():
    """``bench --engines 64`` on two cores used to advise "lower --clients", an option --engines refuses."""
    cap = max(MIN_CLIENT_CAP, MAX_CLIENTS_PER_CORE * (os.cpu_count() or 1))
    instances = min(256, cap // 256 + 1)  # instances × 256 engines' clients > the cap on any host
    code, out = _bench("--embedded", str(instances), "--engines", "256")
    assert code == 2, out
    assert "lower --engines" in out and "--clients" not in out, out


def test_engine_buffers_past_the_host_advise_fewer_engines():
    code, out = _bench("--embedded", "1", "--engines", "4", "--chunk-bytes", "1e9", "--batch", "64")
    assert code == 2 and "more than half" in out, out
    assert "--engines" in out and "--clients" not in out, out


def test_a_plain_bench_still_advises_fewer_clients():
    code, out = _bench("--embedded", "1", "--clients", "4", "--chunk-bytes", "1e9", "--batch", "64")
    assert code == 2 and "lower --clients" in out, out
