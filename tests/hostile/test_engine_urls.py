"""Engine URLs under hostile spellings (issue 30, items 10 and 11): credentials in any query name are
masked, and one engine spelled two ways is read once.

Real kvctl runs (in process, and as a process for the exporter) against real local HTTP servers.
"""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from kvctl.cli import cli

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
    from kvctl.engine_http import SECRET_NAME_PARTS  # noqa: PLC0415

    text = (Path(__file__).resolve().parents[2] / "docs" / "reliability.md").read_text()
    assert all(f"`{p}`" in text for p in SECRET_NAME_PARTS), [p for p in SECRET_NAME_PARTS if f"`{p}`" not in text]
