"""Fixtures of the connector's tests."""

from __future__ import annotations

import pytest

from kvctl.connector import resp_conn


@pytest.fixture
def waitall_calls(monkeypatch):
    """The lengths of the payloads that took the ``MSG_WAITALL`` receive (a spy around the real method)."""
    calls: list[int] = []
    real = resp_conn.Connection._recv_all_into

    def spy(self, dest, crlf):
        calls.append(len(dest))
        return real(self, dest, crlf)

    monkeypatch.setattr(resp_conn.Connection, "_recv_all_into", spy)
    return calls
