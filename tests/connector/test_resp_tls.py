"""TLS (``rediss://``) through the standard library.

The embedded Valkey binary is built without TLS ("Missing implement of
connection type tls"), so end-to-end TLS runs through :class:`TlsProxy`, a
tiny test-only TLS terminator (Python ``ssl`` with a throw-away self-signed
certificate from the ``openssl`` CLI) in front of a real Valkey. The client
side -- URL parsing, context construction, handshake, verification -- is the
real code path.
"""

from __future__ import annotations

import select
import shutil
import socket
import ssl
import subprocess
import threading

import pytest

from kvctl.connector.resp import RespClient, RespConnectionError, make_ssl_context
from kvctl.connector.urls import InvalidUrl, parse_resp_url


def test_ssl_context_from_url(tmp_path):
    ctx = make_ssl_context(parse_resp_url("rediss://h:6380"))
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    loose = make_ssl_context(parse_resp_url("rediss://h:6380?ssl_cert_reqs=none"))
    assert loose.verify_mode == ssl.CERT_NONE and not loose.check_hostname
    with pytest.raises(InvalidUrl, match="TLS CA file"):
        make_ssl_context(parse_resp_url(f"rediss://h?ssl_ca_certs={tmp_path / 'absent.pem'}"))


class TlsProxy:
    """Test double (not Valkey): accepts TLS on loopback and pipes bytes to a plain Valkey."""

    def __init__(self, cert: str, key: str, backend: tuple[str, int]) -> None:
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(cert, key)
        self.backend = backend
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.port = self.listener.getsockname()[1]
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                raw, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            raw.settimeout(5)
            try:
                tls = self.ctx.wrap_socket(raw, server_side=True)
            except (ssl.SSLError, OSError):
                raw.close()
                continue
            up = socket.create_connection(self.backend, timeout=5)
            self._socks += [tls, up]
            threading.Thread(target=self._pump, args=(tls, up), daemon=True).start()

    def _pump(self, tls: ssl.SSLSocket, up: socket.socket) -> None:
        """One thread per connection: an SSL object must not be read and written concurrently."""
        try:
            while not self._stop.is_set():
                readable, _, _ = select.select([tls, up], [], [], 0.1)
                if tls.pending() or tls in readable:
                    data = tls.recv(262144)
                    if not data:
                        break
                    up.sendall(data)
                if up in readable:
                    data = up.recv(262144)
                    if not data:
                        break
                    tls.sendall(data)
        except OSError:
            pass
        finally:
            for s in (tls, up):
                try:
                    s.close()
                except OSError:
                    pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.listener.close()
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass


@pytest.fixture
def tls_proxy(valkey_server, tmp_path):
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl CLI not available to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=30,
    )
    proxy = TlsProxy(str(cert), str(key), (valkey_server.host, valkey_server.port))
    try:
        yield proxy, str(cert)
    finally:
        proxy.stop()


def test_rediss_roundtrip_with_verified_certificate(tls_proxy):
    proxy, cert = tls_proxy
    url = f"rediss://127.0.0.1:{proxy.port}?ssl_ca_certs={cert}"
    with RespClient(url, timeout_s=5.0) as client:
        value = bytes(range(256)) * 2000
        client.batched_set(["tls-a", "tls-b"], [value, b"small"])
        bufs = [bytearray(len(value)), bytearray(5), bytearray(1)]
        assert client.batched_get(["tls-a", "tls-b", "tls-none"], bufs) == [True, True, False]
        assert bytes(bufs[0]) == value and bufs[1] == b"small"


def test_rediss_rejects_untrusted_certificate(tls_proxy):
    proxy, _ = tls_proxy
    with RespClient(f"rediss://127.0.0.1:{proxy.port}", timeout_s=5.0) as client:
        with pytest.raises(RespConnectionError, match="TLS"):
            client.ping()
    with RespClient(f"rediss://127.0.0.1:{proxy.port}?ssl_cert_reqs=none", timeout_s=5.0) as client:
        assert client.ping()


def test_rediss_against_plain_server_fails_fast(valkey_server):
    with RespClient(f"rediss://{valkey_server.host}:{valkey_server.port}", timeout_s=1.0) as client:
        with pytest.raises(RespConnectionError):
            client.ping()


def test_unreadable_ca_file_is_a_clear_url_error(tmp_path):
    missing = tmp_path / "no-such-ca.pem"
    with pytest.raises(InvalidUrl, match="TLS CA file"):
        RespClient(f"rediss://127.0.0.1:6390?ssl_ca_certs={missing}", timeout_s=1.0)


def test_admin_reads_through_tls_and_an_acl_user(tls_proxy, valkey_server):
    """kvctl's admin reads (kvctl.tier.admin: doctor, status, diagnose, the exporter) go through this client: what
    redis-py did for them it does, rediss:// with a verified certificate, an ACL user and db in the URL, a
    --password-file's password over the URL's (through a real Valkey)."""
    from kvctl.tier.admin import Admin, LoginRefused

    proxy, cert = tls_proxy
    with Admin(f"rediss://127.0.0.1:{proxy.port}/0?ssl_ca_certs={cert}", 5.0) as a:
        assert a.info()["process_id"] == valkey_server.pid and a.ping()
    with Admin(valkey_server.url, 5.0) as a:
        a.call("ACL SETUSER", [("ACL", "SETUSER", "reader", "on", ">reader-pw", "+@all", "~*")])
    with Admin(f"resp://reader:wrong@127.0.0.1:{valkey_server.port}/2", 5.0, password="reader-pw") as a:
        assert a.dbsize() == 0 and a.info("server")["process_id"] == valkey_server.pid
    with pytest.raises(LoginRefused, match="refused the login"), Admin(f"resp://reader@127.0.0.1:{valkey_server.port}", 5.0, password="nope") as a:
        a.ping()
