"""Per-rank URL expansion and RESP URL parsing."""

from __future__ import annotations

import pytest

from kvctl.connector.ownership import expand_url
from kvctl.connector.urls import InvalidUrl, parse_resp_url, with_credentials


def test_expand_template():
    assert expand_url("resp://valkey-{rank}:6379", 3) == "resp://valkey-3:6379"
    assert expand_url("resp://127.0.0.1:{rank}0", 7) == "resp://127.0.0.1:70"
    assert expand_url("resp://one:6379", 5) == "resp://one:6379"


def test_expand_list():
    urls = ["resp://a:1", "resp://b:2"]
    assert expand_url(urls, 1) == "resp://b:2"
    with pytest.raises(InvalidUrl, match="no URL for rank 2"):
        expand_url(urls, 2)
    with pytest.raises(InvalidUrl):
        expand_url(urls, -1)
    with pytest.raises(InvalidUrl):
        expand_url(["resp://x-{rank}:1"], 0)


@pytest.mark.parametrize(
    "url, host, port, tls, user, password, db",
    [
        ("resp://127.0.0.1:7000", "127.0.0.1", 7000, False, None, None, 0),
        ("redis://h", "h", 6379, False, None, None, 0),
        ("redis://:s3cret@h:1/2", "h", 1, False, None, "s3cret", 2),
        ("rediss://alice:p%40ss@h:6380", "h", 6380, True, "alice", "p@ss", 0),
        ("redis://alice@h:1", "h", 1, False, "alice", None, 0),
    ],
)
def test_parse(url, host, port, tls, user, password, db):
    u = parse_resp_url(url)
    assert (u.host, u.port, u.tls, u.username, u.password, u.db) == (host, port, tls, user, password, db)
    assert "s3cret" not in repr(u) and "p@ss" not in repr(u)


@pytest.mark.parametrize("bad", ["", "http://h:1", "resp://", "resp://h:notaport", "resp://h:1/x", "resp://v-{rank}:1"])
def test_parse_rejects(bad):
    with pytest.raises(InvalidUrl):
        parse_resp_url(bad)


def test_with_credentials_rules():
    # the URL's ACL user is kept when only a password is given
    assert parse_resp_url(with_credentials("resp://engine@h:1", password="pw")).username == "engine"
    # what is given wins over the URL's own
    u = parse_resp_url(with_credentials("resp://a:old@h:1/2?ssl_cert_reqs=none", user="b", password="p@:/"))
    assert (u.username, u.password, u.db, u.ssl_verify) == ("b", "p@:/", 2, False)
    assert with_credentials("resp://valkey-{rank}:6379", user="kvctl-engine") == "resp://kvctl-engine@valkey-{rank}:6379"
    assert with_credentials("resp://u:p@h:1") == "resp://u:p@h:1"
