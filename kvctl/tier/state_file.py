"""The state file of a local tier, ``<dir>/kvctl-tier.json``: written by ``deploy-valkey up``, read here only.

Every reader (``deploy-valkey status|down|vllm-config|lmcache-config``, ``bench``/``diagnose``/``doctor
--dir``) goes through :func:`load_tier`: a regular file of at most TIER_STATE_MAX_BYTES, JSON, every field
typed and bounded (ranks and instances in tier order, ports 1-65535, instances per rank 1-64 as the connector's
``RANGES``, pids, start times). A bad file is one line naming the file and the key (InvalidInput, exit 2).

No path is taken from the file. The tier is the directory the file was read from (``TierState.dir``, whatever
the file's own ``dir`` says: a copied or moved directory is its own), and an instance's files are named by
its rank and instance (:func:`instance_stem`); a recorded name that differs is refused, an absolute path of
the same name (state files of older kvctl) is read as that name in this directory.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from kvctl.connector.urls import MAX_INSTANCES_PER_RANK, InvalidUrl, parse_resp_url
from kvctl.core.errors import InvalidInput
from kvctl.core.files import read_json, write_atomic
from kvctl.core.known_keys import log_unknown, unknown
from kvctl.core.thresholds import TIER_STATE_MAX_BYTES
from kvctl.tier.spec import CONTROL, MAX_IO_THREADS

log = logging.getLogger(__name__)

STATE_FILE = "kvctl-tier.json"
#: The engine user's password, written by ``up`` when the tier has a password.
ENGINE_PASSWORD_FILE = "engine.password"
#: Held (flock) by ``up`` and ``down`` while they work on the directory.
LOCK_FILE = ".kvctl-tier.lock"
#: What each instance writes: ``valkey-<r>.conf|.log|.pid`` (``valkey-<r>-<i>.*`` with several per rank).
INSTANCE_SUFFIXES = (".conf", ".log", ".pid")
#: Linux's largest pid (``/proc/sys/kernel/pid_max`` cannot exceed 2^22).
PID_MAX = 1 << 22
_MAX_TEXT = 4096  # any string field: a path, a version, a time stamp
_MAX_CMDLINE = 64


def instance_stem(rank: int, instance: int, instances_per_rank: int) -> str:
    """The name of an instance's files in the tier directory, less the suffix: ``valkey-2`` or ``valkey-2-1``."""
    return f"valkey-{rank}" if instances_per_rank == 1 else f"valkey-{rank}-{instance}"


@dataclass
class InstanceState:
    rank: int
    host: str
    port: int
    pid: int
    url: str
    config: str  # file names in the tier directory (instance_stem + suffix)
    logfile: str
    pidfile: str
    cmdline: list[str] = field(default_factory=list)
    create_time: float = 0.0  # psutil create_time at start: guards against pid reuse
    instance: int = 0  # which of its rank's instances (0 … instances_per_rank - 1)


@dataclass
class TierState:
    """What ``deploy-valkey up`` started in a directory (``<dir>/kvctl-tier.json``)."""

    dir: str
    instances: list[InstanceState]
    binary: str = ""
    server_version: str = ""
    maxmemory_total: int = 0
    password_file: str | None = None
    created_at: str = ""
    maxmemory_per_instance: int = 0
    io_threads: int = 0
    engine_user: str | None = None  # ACL user for engines (only with a password)
    engine_password_file: str | None = None  # read back as <dir>/engine.password
    complete: bool = True  # False while `up` is still starting instances (or when it died midway)
    instances_per_rank: int = 1  # K: rank r's instances are r*K … r*K + K - 1 of ``instances``
    stopped_at: str = ""  # when `down` stopped every server of the tier (its files kept); "" while it runs

    @property
    def ranks(self) -> int:
        return len({i.rank for i in self.instances})

    def in_tier_order(self) -> list[InstanceState]:
        """The instances rank by rank, each rank's in instance order (tier number r*K + i)."""
        return sorted(self.instances, key=lambda i: (i.rank, i.instance))

    def write(self) -> Path:
        """Atomically write the state file: file names, never paths (the engine password as ``engine.password``)."""
        doc = asdict(self)
        if doc["engine_password_file"]:
            doc["engine_password_file"] = ENGINE_PASSWORD_FILE
        return write_atomic(Path(self.dir) / STATE_FILE, json.dumps(doc, indent=2) + "\n")


def state_path(tier_dir: Path | str) -> Path:
    return Path(tier_dir) / STATE_FILE


def load_tier(tier_dir: Path | str) -> TierState:
    """The state file of the local tier in ``tier_dir``, every field checked; InvalidInput (one line) when absent or bad."""
    path = state_path(tier_dir)
    if not os.path.lexists(path):
        raise InvalidInput(f"{tier_dir} holds no kvctl tier ({STATE_FILE} missing); start one with `kvctl deploy-valkey up --dir {tier_dir}`")
    raw = read_json(path, "tier state", TIER_STATE_MAX_BYTES, kind="a kvctl tier state file")
    _say_unknown(raw, path)
    return _Reader(path).tier(raw, Path(tier_dir).resolve())


def _say_unknown(raw: Any, path: Path) -> None:
    """A key the state file holds that no reader knows (a hand edit, a newer kvctl's): one warning each, with the nearest."""
    if not isinstance(raw, dict):
        return
    found = unknown(raw, {f.name for f in fields(TierState)}, f"tier state {path}")
    for n, x in enumerate(raw.get("instances") if isinstance(raw.get("instances"), list) else []):
        if isinstance(x, dict):
            found += unknown(x, {f.name for f in fields(InstanceState)}, f"tier state {path}", f"instances[{n}].")
    log_unknown(found, log, "kvctl ignores it")


class _Reader:
    """Checks one parsed state file; every refusal names ``path`` and the key."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def bad(self, key: str, why: str, value: Any = None, show: bool = True) -> InvalidInput:
        shown = f", got {_short(value)}" if show else ""
        return InvalidInput(f"tier state {self.path}: {key} {why}{shown}; fix the file, or remove it (`kvctl deploy-valkey down` "
                            "finds the tier's servers without it)")

    def integer(self, obj: dict, key: str, where: str, lo: int, hi: int, default: int | None = None) -> int:
        v = obj.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise self.bad(where + key, f"must be an integer in {lo}..{hi}", v)
        return v

    def text(self, obj: dict, key: str, where: str, default: str | None = "", optional: bool = False) -> str | None:
        v = obj.get(key, default)
        if v is None and optional:
            return None
        if not isinstance(v, str) or len(v) > _MAX_TEXT or CONTROL.search(v):
            raise self.bad(where + key, f"must be a string (at most {_MAX_TEXT} characters, no control character)", v)
        return v

    def file_name(self, obj: dict, key: str, where: str, expected: str) -> str:
        """``expected`` when the file records it (or an absolute path ending in it, or nothing); else refused."""
        v = self.text(obj, key, where)
        if v and v != expected and not (os.path.isabs(v) and os.path.basename(v) == expected):
            raise self.bad(where + key, f"must name {expected} in the tier directory (kvctl removes only its own files there)", v)
        return expected

    def tier(self, raw: Any, tier_dir: Path) -> TierState:
        if not isinstance(raw, dict):
            raise self.bad("the file", "is not a JSON object", show=False)
        k = self.integer(raw, "instances_per_rank", "", 1, MAX_INSTANCES_PER_RANK, default=1)
        insts = raw.get("instances")
        if not isinstance(insts, list) or not 1 <= len(insts) <= 65535:
            raise self.bad("instances", "must be a list of 1 to 65,535 instances", insts)
        instances = [self.instance(x, n, k) for n, x in enumerate(insts)]
        ports = set()
        for n, inst in enumerate(instances):
            if inst.port in ports:
                raise self.bad(f"instances[{n}].port", "is another instance's port too", inst.port)
            ports.add(inst.port)
        self.text(raw, "dir", "")  # typed, never used: the tier is the directory the file was read from
        engine_user = self.text(raw, "engine_user", "", default=None, optional=True)
        if engine_user is not None and (not engine_user or any(c.isspace() for c in engine_user)):
            raise self.bad("engine_user", "must be one ACL user name", engine_user)
        password_file = self.text(raw, "password_file", "", default=None, optional=True)
        if password_file is not None and not os.path.isabs(password_file):
            raise self.bad("password_file", "must be an absolute path", password_file)
        epf = raw.get("engine_password_file")
        if epf is not None:
            self.file_name(raw, "engine_password_file", "", ENGINE_PASSWORD_FILE)
        complete = raw.get("complete", True)
        if not isinstance(complete, bool):
            raise self.bad("complete", "must be true or false", complete)
        io_threads = self.integer(raw, "io_threads", "", 1, MAX_IO_THREADS) if "io_threads" in raw else 0
        return TierState(
            dir=str(tier_dir),
            instances=instances,
            binary=self.text(raw, "binary", "") or "",
            server_version=self.text(raw, "server_version", "") or "",
            maxmemory_total=self.integer(raw, "maxmemory_total", "", 0, 2**63, default=0),
            password_file=password_file,
            created_at=self.text(raw, "created_at", "") or "",
            maxmemory_per_instance=self.integer(raw, "maxmemory_per_instance", "", 0, 2**63, default=0),
            io_threads=io_threads,
            engine_user=engine_user,
            engine_password_file=str(tier_dir / ENGINE_PASSWORD_FILE) if epf is not None else None,
            complete=complete,
            instances_per_rank=k,
            stopped_at=self.text(raw, "stopped_at", "") or "",
        )

    def instance(self, x: Any, n: int, k: int) -> InstanceState:
        where = f"instances[{n}]."
        if not isinstance(x, dict):
            raise self.bad(f"instances[{n}]", "must be an object", x)
        rank = self.integer(x, "rank", where, 0, 65534)
        inst = self.integer(x, "instance", where, 0, k - 1, default=0)
        if (rank, inst) != divmod(n, k):  # `up` records instance r*K + i of rank r as the (r*K + i)-th, in order
            r, i = divmod(n, k)
            raise self.bad(f"instances[{n}]", f"is rank {rank} instance {inst}; in tier order it must be rank {r} instance {i}", show=False)
        port = self.integer(x, "port", where, 1, 65535)
        host = self.text(x, "host", where) or ""
        if not host or any(c.isspace() for c in host):
            raise self.bad(where + "host", "must be one host name or address", host)
        url = self.text(x, "url", where) or ""
        try:
            parsed = parse_resp_url(url)
        except InvalidUrl as e:
            raise self.bad(where + "url", f"is not a RESP URL ({e})", show=False) from None
        if parsed.port != port:
            raise self.bad(where + "url", f"does not name the instance's port {port}", show=False)
        cmdline = x.get("cmdline", [])
        if not isinstance(cmdline, list) or len(cmdline) > _MAX_CMDLINE or not all(isinstance(c, str) and len(c) <= _MAX_TEXT for c in cmdline):
            raise self.bad(where + "cmdline", f"must be a list of at most {_MAX_CMDLINE} strings", cmdline)
        created = x.get("create_time", 0.0)
        if isinstance(created, bool) or not isinstance(created, (int, float)) or not math.isfinite(created) or not 0 <= created < 2**40:
            raise self.bad(where + "create_time", "must be a start time in seconds since 1970", created)
        stem = instance_stem(rank, inst, k)
        return InstanceState(
            rank=rank, host=host, port=port, pid=self.integer(x, "pid", where, 0, PID_MAX), url=url,
            config=self.file_name(x, "config", where, stem + ".conf"),
            logfile=self.file_name(x, "logfile", where, stem + ".log"),
            pidfile=self.file_name(x, "pidfile", where, stem + ".pid"),
            cmdline=list(cmdline), create_time=float(created), instance=inst,
        )


def _short(value: Any) -> str:
    """A value for a message: its repr, control characters escaped, at most 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
