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


def test_one_password_file_reader_one_answer(tmp_path):
    """Issue 22: three readers, only one checking the mode. The one reader: owner-only or group-readable
    (a Kubernetes secret with an fsGroup) is read; open to every user, empty, oversized or not a regular
    file is refused, naming the file and never its content."""
    import os

    from kvctl.connector.urls import PASSWORD_FILE_MAX_BYTES, read_password_file
    from kvctl.core.errors import InvalidInput

    p = tmp_path / "pw"
    p.write_text("s3cret\n")
    for mode in (0o600, 0o400, 0o640, 0o440):
        p.chmod(mode)
        assert read_password_file(p) == "s3cret"
    link = tmp_path / "link"
    link.symlink_to(p)  # how Kubernetes mounts a secret
    assert read_password_file(link) == "s3cret"
    for mode in (0o644, 0o604, 0o606):
        p.chmod(mode)
        with pytest.raises(InvalidInput, match=r"open to every user .*chmod 600") as e:
            read_password_file(p)
        assert "s3cret" not in str(e.value)
    p.chmod(0o600)
    p.write_text("x" * (PASSWORD_FILE_MAX_BYTES + 1))
    with pytest.raises(InvalidInput, match="over the 4,096-byte cap"):
        read_password_file(p)
    p.write_text("  \n")
    with pytest.raises(InvalidInput, match="empty"):
        read_password_file(p)
    with pytest.raises(InvalidInput, match="not a regular file"):
        read_password_file(tmp_path)
    with pytest.raises(InvalidInput, match="cannot read"):
        read_password_file(tmp_path / "missing")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)  # no writer: a blocking open would never return
    with pytest.raises(InvalidInput, match="not a regular file"):
        read_password_file(fifo)
