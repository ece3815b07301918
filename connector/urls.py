"""Remote-tier URLs: per-rank expansion, instances per rank and RESP URL parsing (pure, no I/O).

Two forms name one Valkey instance per rank (paper §5.2):

* a template, ``resp://valkey-{rank}:6379``, where ``{rank}`` becomes the
  worker's rank;
* an explicit list, one URL per rank, index = rank.

A plain URL without ``{rank}`` is the same instance for every rank.

Several instances per rank (beyond the paper; its §7 calls this a
second-level partition within each rank's share): rank ``r`` has ``K``
instances, and its owned chunk ``c`` (``c mod W == r``) lives on instance
:func:`instance_of` ``= (c // W) mod K``. A rank still talks only to its own
instances, the partition depends only on the chunk index, W and K (engines of
the same W and K share every key), and the chunks of one prompt spread evenly.
Named either by a template with ``{rank}`` and ``{instance}``
(``resp://valkey-{rank}-{instance}:6379``) or by a per-rank list whose entries
are lists of K URLs. Instance ``i`` of rank ``r`` is number ``r*K + i`` of the
tier (:func:`flat_instance`): ports and unit names count that way.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import socket
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence
from urllib.parse import parse_qs, quote, unquote, urlsplit, urlunsplit

from kvctl.core.engine_http import MASK, SECRET_NAME_PARTS
from kvctl.core.errors import InvalidInput
from kvctl.core.files import read_password_file  # noqa: F401 - the one reader of password files (files.read_regular), re-exported
from kvctl.core.thresholds import PASSWORD_FILE_MAX_BYTES  # noqa: F401 - re-exported

RANK_PLACEHOLDER = "{rank}"
INSTANCE_PLACEHOLDER = "{instance}"
#: the most instances one rank may stripe its chunks over (a sanity bound: each is a socket pool and threads)
MAX_INSTANCES_PER_RANK = 64
RESP_SCHEMES = ("resp", "redis", "rediss", "resps")
TLS_SCHEMES = ("rediss", "resps")
DEFAULT_PORT = 6379


class InvalidUrl(InvalidInput, ValueError):
    """A remote URL (or URL list) that cannot name a RESP server for this rank."""


def expand_url(template_or_list: str | Sequence[str], rank: int) -> str:
    """The URL rank ``rank`` talks to.

    ``template_or_list`` is either a string (``{rank}`` replaced by the rank;
    a string without the placeholder is returned unchanged) or a sequence of
    URLs indexed by rank.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise InvalidUrl(f"rank must be a non-negative integer, got {rank!r}")
    if isinstance(template_or_list, str):
        return template_or_list.replace(RANK_PLACEHOLDER, str(rank))
    urls = list(template_or_list)
    if rank >= len(urls):
        raise InvalidUrl(f"per-rank URL list has {len(urls)} entries, no URL for rank {rank}")
    url = urls[rank]
    if not isinstance(url, str) or not url:
        raise InvalidUrl(f"per-rank URL for rank {rank} is not a non-empty string: {redact_urls_in(url)!r}")
    if RANK_PLACEHOLDER in url:
        raise InvalidUrl(f"per-rank URL for rank {rank} still contains {RANK_PLACEHOLDER}: {redact_url_text(url)}")
    return url


def instance_of(chunk: int, world_size: int, instances_per_rank: int) -> int:
    """Which of its owner's ``instances_per_rank`` instances holds chunk ``chunk``: ``(chunk // W) mod K``.

    The owner's k-th owned chunk (``chunk = owner + k*W``) goes to instance ``k mod K``, so one prompt's
    chunks spread evenly and the answer depends on nothing but the chunk index, W and K.
    """
    if world_size < 1 or instances_per_rank < 1:
        raise ValueError(f"world_size and instances_per_rank must be >= 1, got {world_size}, {instances_per_rank}")
    if chunk < 0:
        raise ValueError(f"chunk index must be >= 0, got {chunk}")
    return (chunk // world_size) % instances_per_rank


def flat_instance(rank: int, instance: int, instances_per_rank: int) -> int:
    """The tier-wide number of rank ``rank``'s instance ``instance``: ``rank*K + instance`` (ports, unit names)."""
    return rank * instances_per_rank + instance


def expand_rank_urls(template_or_list: str | Sequence, rank: int, instances_per_rank: int = 1) -> list[str]:
    """The URLs of rank ``rank``'s ``instances_per_rank`` instances, in instance order.

    ``template_or_list``: a template (``{rank}`` and, when K > 1, ``{instance}``), or a per-rank list
    whose entry ``rank`` is one URL (K = 1) or a list of K URLs.
    """
    if isinstance(instances_per_rank, bool) or not isinstance(instances_per_rank, int) or not (
            1 <= instances_per_rank <= MAX_INSTANCES_PER_RANK):
        raise InvalidUrl(f"instances per rank must be a whole number in 1..{MAX_INSTANCES_PER_RANK}, "
                         f"got {instances_per_rank!r}")
    k = instances_per_rank
    if isinstance(template_or_list, str):
        if INSTANCE_PLACEHOLDER in template_or_list:
            base = expand_url(template_or_list, rank)
            return [base.replace(INSTANCE_PLACEHOLDER, str(i)) for i in range(k)]
        if k > 1:
            raise InvalidUrl(f"{k} instances per rank need {INSTANCE_PLACEHOLDER} in the URL template "
                             f"(e.g. resp://valkey-{{rank}}-{{instance}}:6379) or a list of {k} URLs per rank: "
                             f"{redact_url_text(template_or_list)}")
        return [expand_url(template_or_list, rank)]
    entries = list(template_or_list)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise InvalidUrl(f"rank must be a non-negative integer, got {rank!r}")
    if rank >= len(entries):
        raise InvalidUrl(f"per-rank URL list has {len(entries)} entries, no URL for rank {rank}")
    entry = entries[rank]
    if isinstance(entry, str):
        entry = [entry]
    if not isinstance(entry, (list, tuple)):
        raise InvalidUrl(f"per-rank entry for rank {rank} is neither a URL nor a list of URLs: {redact_urls_in(entry)!r}")
    if len(entry) != k:
        raise InvalidUrl(f"rank {rank} has {len(entry)} URL(s), expected {k} (one per instance of the rank)")
    out = []
    for i, url in enumerate(entry):
        if not isinstance(url, str) or not url:
            raise InvalidUrl(f"URL of rank {rank} instance {i} is not a non-empty string: {redact_urls_in(url)!r}")
        if RANK_PLACEHOLDER in url or INSTANCE_PLACEHOLDER in url:
            raise InvalidUrl(f"URL of rank {rank} instance {i} still contains a placeholder: {redact_url_text(url)}")
        out.append(url)
    return out


def instances_in(template_or_list: str | Sequence) -> int | None:
    """K as a per-rank list of lists spells it (every entry the same length), 1 for a list of URLs, None for a template."""
    if isinstance(template_or_list, str):
        return None
    sizes = {1 if isinstance(e, str) else len(e) if isinstance(e, (list, tuple)) else -1 for e in template_or_list}
    if not sizes:
        return 1
    if len(sizes) != 1 or -1 in sizes:
        raise InvalidUrl("every rank's entry must be one URL or a list of the same number of URLs")
    return sizes.pop()


@dataclass(frozen=True)
class RespUrl:
    """A parsed ``resp://``, ``redis://`` or ``rediss://`` URL."""

    host: str
    port: int
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    db: int = 0
    ssl_ca_certs: str | None = None  # ?ssl_ca_certs=/path/ca.pem
    ssl_verify: bool = True  # ?ssl_cert_reqs=none turns verification off (test rigs only)

    def redacted(self) -> str:
        """The URL with any password masked, for messages and logs."""
        scheme = "rediss" if self.tls else "resp"
        auth = ""
        if self.password is not None:
            auth = f"{self.username or ''}:***@"
        elif self.username:
            auth = f"{self.username}@"
        return f"{scheme}://{auth}{self.host}:{self.port}/{self.db}"


def with_credentials(url: str, user: str | None = None, password: str | None = None) -> str:
    """``url`` logging in as ``user`` with ``password``: the one place kvctl puts credentials into a URL.

    What is given wins over what the URL says (a ``--password-file`` over a password written in the URL,
    a configured ACL user over the URL's); what is not given (None) keeps the URL's own. The URL's
    scheme, host, port, db and options are kept; a ``{rank}`` template stays a template.
    """
    if user is None and password is None:
        return url
    parts = urlsplit(url)
    old_auth, _, host = parts.netloc.rpartition("@")
    old_user, _, old_password = old_auth.partition(":")
    user_part = quote(user, safe="") if user is not None else old_user
    password_part = quote(password, safe="") if password is not None else old_password
    auth = user_part + (f":{password_part}" if password_part else "")
    netloc = f"{auth}@{host}" if auth else host
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def parse_resp_url(url: str) -> RespUrl:
    """Parse a RESP server URL: ``scheme://[user[:password]@]host[:port][/db][?options]``.

    ``resp`` and ``redis`` are plain TCP, ``rediss`` (or ``resps``) is TLS.
    ``redis://:secret@host`` gives a password with the default user.
    TLS options: ``ssl_ca_certs=<path>`` and ``ssl_cert_reqs=none|required``.
    """
    if not isinstance(url, str) or not url:
        raise InvalidUrl(f"empty RESP URL: {redact_urls_in(url)!r}")
    for placeholder in (RANK_PLACEHOLDER, INSTANCE_PLACEHOLDER):
        if placeholder in url:
            raise InvalidUrl(f"URL still contains {placeholder}; expand it first: {redact_url_text(url)}")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in RESP_SCHEMES:
        raise InvalidUrl(f"unsupported scheme {parts.scheme!r} in {redact_url_text(url)!r}: use resp://, redis:// or rediss://")
    try:
        host = parts.hostname
        port = parts.port or DEFAULT_PORT
    except ValueError:  # urllib's message quotes the text it took for a port: a password's first part, maybe
        raise InvalidUrl(f"bad host/port in RESP URL {redact_url_text(url)!r}") from None
    if not host:
        raise InvalidUrl(f"no host in RESP URL {redact_url_text(url)!r}")
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    if password == "":
        password = None
    db = 0
    path = parts.path.strip("/")
    if path:
        try:
            db = int(path)
        except ValueError:
            raise InvalidUrl(f"database in RESP URL {redact_url_text(url)!r} must be an integer") from None
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    unknown = set(query) - {"ssl_ca_certs", "ssl_cert_reqs"}
    if unknown:
        raise InvalidUrl(f"unknown RESP URL option(s): {', '.join(sorted(unknown))}")
    reqs = query.get("ssl_cert_reqs", "required").lower()
    if reqs not in ("required", "none"):
        raise InvalidUrl(f"ssl_cert_reqs must be 'required' or 'none', got {reqs!r}")
    return RespUrl(
        host=host,
        port=port,
        tls=scheme in TLS_SCHEMES,
        username=username,
        password=password,
        db=db,
        ssl_ca_certs=query.get("ssl_ca_certs"),
        ssl_verify=reqs == "required",
    )


_SECRET_QUERY = re.compile(r"(?i)([?&][^=&#]*(?:" + "|".join(map(re.escape, SECRET_NAME_PARTS)) + r")[^=&#]*=)[^&#]*")


def redact_url_text(url: str) -> str:
    """``url`` as written, its password (and any secret-named query value) replaced by ``***``.

    For text that may not parse: a template, a URL a config holds, one with an unquoted '/' or '@' in its
    password. Everything up to the last '@' after ``scheme://`` is user info: the user (before the first
    ':') stays, the rest is masked, so a password is never shown whatever it holds.
    """
    if not isinstance(url, str):
        return url
    head, sep, rest = url.partition("://")
    if not sep:  # no scheme: "user:password@host:port" is masked, any other text (a name with '@') kept
        head, rest = "", url
    at = rest.rfind("@")
    if at >= 0:
        user, has_pw, _ = rest[:at].partition(":")
        if any(c in user for c in "/?#"):
            user, has_pw = "", ":"
        if has_pw or sep:
            rest = f"{user}:{MASK}@{rest[at + 1:]}" if has_pw else f"{user}@{rest[at + 1:]}"
    return _SECRET_QUERY.sub(lambda m: m.group(1) + MASK, head + sep + rest) if sep else rest


def redact_urls_in(value: Any, redact: Callable[[str], str] = redact_url_text) -> Any:
    """``value`` (a string, or lists, tuples, dicts of them) with every URL in it through ``redact``."""
    if isinstance(value, str):
        return redact(value) if "@" in value or "://" in value else value
    if isinstance(value, (list, tuple)):
        out = [redact_urls_in(v, redact) for v in value]
        return tuple(out) if isinstance(value, tuple) else out
    if isinstance(value, dict):
        return {k: redact_urls_in(v, redact) for k, v in value.items()}
    return value


def redacted_repr(obj: Any, redact: Callable[[str], str] = redact_url_text) -> str:
    """A dataclass's repr with every URL in its fields (strings, lists, tuples, dicts of them) passed through
    ``redact``; fields declared ``repr=False`` stay out, nested objects show their own repr.

    Use as ``__repr__ = redacted_repr`` in the class body (a dataclass keeps a ``__repr__`` its class defines).
    """
    shown = ", ".join(f"{f.name}={redact_urls_in(getattr(obj, f.name), redact)!r}"
                      for f in dataclasses.fields(obj) if f.repr)
    return f"{type(obj).__qualname__}({shown})"


#: names that are this host's loopback whatever else they resolve to (no lookup is made for any name)
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def server_address(url: str | RespUrl) -> tuple[str, int]:
    """(host, port) of the server ``url`` reaches, as one spelling: every loopback spelling (``localhost``,
    127.x.y.z, ``::1``, ``0.0.0.0``, ``::``, IPv4-mapped forms) is ``loopback``; an IP literal in any form the
    resolver takes (``127.1``, ``0x7f.0.0.1``, ``[::FFFF:10.0.0.1]``) is its canonical address; any other
    name is compared as spelled, lower-case, without a trailing dot. No DNS lookup is made.
    """
    parsed = parse_resp_url(url) if isinstance(url, str) else url
    host = parsed.host.lower().rstrip(".").split("%", 1)[0]
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
        if re.fullmatch(r"[0-9a-fx.]+", host) and not host.endswith("."):
            try:  # inet_aton's legacy forms, which the resolver connects to: 127.1, 0x7f000001 (pure parsing)
                ip = ipaddress.IPv4Address(socket.inet_aton(host))
            except OSError:
                ip = None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if host in LOOPBACK_NAMES or (ip is not None and (ip.is_loopback or ip.is_unspecified)):
        return "loopback", parsed.port
    return (str(ip) if ip is not None else host), parsed.port


def check_distinct_servers(rank_urls: Sequence[Sequence[str]]) -> None:
    """InvalidUrl unless every instance of every rank (``rank_urls[r][i]``) is a server of its own
    (:func:`server_address`); one line naming both spellings, passwords masked. For K > 1 instances per
    rank (with one, the ranks may share the one server a plain URL names).

    Two spellings of one server (``127.0.0.1:7000`` and ``localhost:7000``, ``resp://h:7000`` and
    ``redis://h:7000/0``, or db 0 and db 1 of one server) would stripe a rank's chunks over one server
    twice: the bytes stay right, the bandwidth the instances were meant to add never comes.
    """
    seen: dict[tuple[str, int], tuple[int, int, str]] = {}
    for rank, urls in enumerate(rank_urls):
        for i, url in enumerate(urls):
            addr = server_address(url)
            if addr in seen:
                r0, i0, first = seen[addr]
                where = f"instances {i0} and {i} of rank {rank}" if r0 == rank else (
                    f"rank {r0} instance {i0} and rank {rank} instance {i}")
                raise InvalidUrl(f"{where} are one server ({redact_url_text(first)} and {redact_url_text(url)}, "
                                 f"{addr[0]} port {addr[1]}): each instance needs its own server")
            seen[addr] = (rank, i, url)
