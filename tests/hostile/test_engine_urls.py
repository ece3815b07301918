"""Engine URLs under hostile spellings (issue 30, items 10 and 11): credentials in any query name are
masked, and one engine spelled two ways is read once.

Real kvctl runs (in process, and as a process for the exporter) against real local HTTP servers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from tests.diagnose.engine_text import EngineState
from tests.diagnose.metrics_server import MetricsServer
from tests.exporter.helpers import ExporterProcess
from tests.hostile.helpers import kvctl_env

#: query names seen carrying credentials, each with its own value (none may be printed)
CREDENTIAL_NAMES = ["jwt", "bearer", "id_jwt", "Bearer_Token", "X-Amz-Signature", "client_secret", "passwd", "pwd", "apikey",
                    "sessionid", "auth", "code", "otp", "ticket", "hmac", "private_key", "refresh_token", "cred"]


def _diagnose(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(cli, ["diagnose", *args])
    return r.exit_code, r.output


def test_every_credential_looking_query_value_is_masked():
    """Item 10: ``--engine-url 'http://h/metrics?jwt=S'`` printed S in the --json output (and bearer=, ...)."""
    query = "&".join(f"{n}=S3CRET{i}x" for i, n in enumerate(CREDENTIAL_NAMES))
    code, out = _diagnose("--engine-url", f"http://127.0.0.1:1/metrics?model=glm&{query}", "--window", "0.1", "--timeout", "0.5",
                          "--json")
    assert code == 5, out
    assert "S3CRET" not in out, [n for i, n in enumerate(CREDENTIAL_NAMES) if f"S3CRET{i}x" in out]
    assert "model=glm" in out  # a name that is not a credential stays readable


def test_the_masked_names_are_the_ones_the_docs_list():
    from kvctl.core.engine_http import SECRET_NAME_PARTS  # noqa: PLC0415

    text = (Path(__file__).resolve().parents[2] / "docs" / "reliability.md").read_text()
    assert all(f"`{p}`" in text for p in SECRET_NAME_PARTS), [p for p in SECRET_NAME_PARTS if f"`{p}`" not in text]


# ----------------------------------------------------------------------------- item 11: one engine, two spellings


@pytest.fixture
def engine():
    before, after = EngineState(), EngineState().advance(requests=10, prompt_lengths=[16000] * 10)
    with MetricsServer([before.text(), after.text()]) as srv:
        yield srv


def _spellings(url: str) -> list[str]:
    port = url.rsplit(":", 1)[1]
    return [f"http://127.0.0.1:{port}", f"http://localhost:{port}/metrics", f"HTTP://LocalHost:{port}/"]


def test_diagnose_reads_one_engine_spelled_three_ways_once(engine):
    """Item 11: ``localhost`` and ``127.0.0.1`` counted as two engines, so λ and each ρ doubled."""
    code, out = _diagnose(*[a for u in _spellings(engine.url) for a in ("--engine-url", u)], "--window", "0.2", "--json",
                          "--bytes-per-token", "48437.5", "--prefill-rate", "52200")
    data = json.loads(out)
    assert data["engine_urls"] == [f"{engine.url}"], data["engine_urls"]
    assert engine.hits == 2  # one engine, two samples


def test_diagnose_warns_when_it_merges_spellings(engine):
    code, out = _diagnose(*[a for u in _spellings(engine.url) for a in ("--engine-url", u)], "--window", "0.2")
    flat = " ".join(out.split())
    assert "reach the same engine" in flat and "localhost" in flat, out


def test_the_exporter_samples_one_engine_spelled_two_ways_once(engine, tmp_path):
    urls = _spellings(engine.url)[:2]
    with ExporterProcess(["--engine-url", urls[0], "--engine-url", urls[1], "--interval", "5"], env=kvctl_env(tmp_path / "home")) as ex:
        assert ex.start["engines"] == [engine.url], ex.start
    assert "reach the same engine" in ex.err, ex.err
