"""What a per-rank Valkey tier looks like, whatever the target (local, systemd, k8s).

Pure helpers shared by :mod:`kvctl.tier.local` and :mod:`kvctl.tier.render_targets`:
size parsing, the security rules (loopback or a password), the engine's ACL user, and the cache-only Valkey
settings (the io-threads and the copy-free reply: :mod:`kvctl.tier.sizing`).
"""

from __future__ import annotations

import ipaddress
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from kvctl.core import sizes
from kvctl.core.errors import InvalidInput
from kvctl.core.files import read_password_file, write_atomic
from kvctl.tier.sizing import zero_copy_settings

#: ACL user the engines log in as when the tier has a password.
ENGINE_USER = "kvctl-engine"
#: The only commands the connector needs: chunk GET/SET/EXISTS (single and batched),
#: liveness, the handshake, and client naming. No FLUSH*, CONFIG, KEYS, DEBUG, ...
ENGINE_COMMANDS = (
    "get", "set", "exists", "mget", "mset", "ping", "auth", "hello", "select",
    "client|setname", "client|setinfo", "quit",
)  # fmt: skip

#: Per-instance memory below this is certainly a typo (LRU thrashes on one 12 MB chunk).
MIN_INSTANCE_BYTES = 10**6
#: Valkey refuses more io-threads than this (Valkey 8: "between 1 and 256").
MAX_IO_THREADS = 256

#: Characters no value written into a Valkey config, a systemd unit or a k8s manifest may hold: in any of
#: them a line break starts a directive of its own (C0 and C1 controls, DEL, Unicode line separators).
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
#: A host as a bind address or a URL's host: a name or an IPv4/IPv6 literal (a zone index after %), nothing else.
_HOST = re.compile(r"^[A-Za-z0-9._:%\[\]-]{1,253}$")


def check_text(value: object, what: str, secret: bool = False) -> None:
    """InvalidInput when ``value`` holds a control character (a newline would add a directive to whatever file it
    is written into). ``secret``: the value is never quoted in the message."""
    if value is not None and CONTROL.search(str(value)):
        shown = "" if secret else f" {str(value)!r}"
        raise InvalidInput(f"{what}{shown} holds a control character (a newline?): refused, it would start a line of its own in a config")


def check_host(host: str, what: str = "--host") -> None:
    """InvalidInput unless ``host`` is one host name or address (no space, no quote, no control character):
    what goes into a ``bind`` directive and the engines' URLs."""
    check_text(host, what)
    if not _HOST.match(host):
        raise InvalidInput(f"{what} {host!r} is not a host name or address (one name, IPv4 or IPv6 literal; no spaces)")

# kvctl's one size syntax (every byte-sized option, through commands.options.ByteSize): kvctl.core.sizes
# (kB/MB/GB powers of 1000, KiB/MiB/GiB powers of 1024, a bare number bytes)
parse_size = sizes.parse_size


def format_size(n: int) -> str:
    """Short binary size for tables: 400.0 MiB."""
    for unit, factor in (("PiB", 1024**5), ("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= factor:
            return f"{n / factor:.1f} {unit}"
    return f"{n} B"


def split_maxmemory(total: str | int, ranks: int, instances_per_rank: int = 1) -> int:
    """Per-instance maxmemory (bytes) when ``total`` is split evenly across ``ranks`` × ``instances_per_rank`` instances."""
    if ranks < 1:
        raise InvalidInput(f"--ranks must be at least 1, got {ranks}")
    n = ranks * instances_per_rank
    per = parse_size(total) // n
    if per < MIN_INSTANCE_BYTES:
        over = f"{ranks} ranks" if instances_per_rank == 1 else f"{ranks} ranks × {instances_per_rank} instances"
        raise InvalidInput(f"--maxmemory {total} over {over} leaves {per} bytes per instance; give at least 1MB per {'rank' if instances_per_rank == 1 else 'instance'}")
    return per


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Auth:
    """The tier's password rule, resolved. ``password`` never goes to stdout or logs."""

    password: str | None = field(default=None, repr=False)
    password_file: str | None = None
    insecure_no_auth: bool = False

    @property
    def enabled(self) -> bool:
        return self.password is not None


def resolve_auth(bind_hosts: list[str] | tuple[str, ...] | str, password_file: str | None, insecure_no_auth: bool) -> Auth:
    """Loopback needs nothing; any other bind address needs a 0600 password file or --insecure-no-auth."""
    hosts = [bind_hosts] if isinstance(bind_hosts, str) else list(bind_hosts)
    if password_file and insecure_no_auth:
        raise InvalidInput("give --password-file or --insecure-no-auth, not both")
    if password_file:
        password = read_password_file(password_file)
        check_text(password, f"the password in {password_file}", secret=True)
        return Auth(password, str(Path(password_file).resolve()))
    exposed = [h for h in hosts if not is_loopback(h)]
    if exposed and not insecure_no_auth:
        raise InvalidInput(
            f"binding {exposed[0]} exposes the tier beyond this host: give --password-file (mode 0600) or, deliberately, --insecure-no-auth"
        )
    return Auth(insecure_no_auth=bool(exposed) and insecure_no_auth)


def new_engine_password() -> str:
    return secrets.token_urlsafe(24)


def engine_acl(engine_password: str, user: str = ENGINE_USER) -> tuple[str, ...]:
    """The arguments of an ACL ``user`` directive (a tuple: :func:`kvctl.tier.server.render_config` writes them as
    one directive, each argument quoted as it needs): all keys, only :data:`ENGINE_COMMANDS`."""
    return (user, "on", f">{engine_password}", "~*", "resetchannels", "-@all", *(f"+{c}" for c in ENGINE_COMMANDS))


def cache_settings(maxmemory_bytes: int, io_threads: int, auth: Auth, engine_password: str | None = None,
                   version: object = None) -> dict[str, object]:
    """Valkey directives every instance of a tier gets (besides port/bind/paths).

    A cache, not a store: LRU over all keys, no RDB, no AOF. ``protected-mode``
    stays on unless the operator chose --insecure-no-auth on a non-loopback
    address (with it on, Valkey would refuse every remote client). ``version``: the server's (a tuple, ``9.1.2``
    or an image reference); 9.x gets the copy-free reply at ``io_threads`` (:func:`kvctl.tier.sizing.zero_copy_settings`).
    """
    if io_threads < 1:
        raise InvalidInput(f"--io-threads must be at least 1, got {io_threads}")
    conf: dict[str, object] = {
        "maxmemory": maxmemory_bytes,
        "maxmemory-policy": "allkeys-lru",
        "save": "",
        "appendonly": "no",
        "io-threads": io_threads,
        **zero_copy_settings(version, io_threads),
        "protected-mode": "no" if auth.insecure_no_auth else "yes",
    }
    if auth.enabled:
        conf["requirepass"] = auth.password
        if engine_password:
            conf["user"] = [engine_acl(engine_password)]
    return conf


def write_secret(path: Path, text: str) -> None:
    """Write ``text`` to an owner-only (0600) file, created with that mode, in one rename."""
    write_atomic(path, text, mode=0o600)
