"""``kvctl doctor``: one pass over a deployment's engine, tier, configs and host; a checklist with fixes.

Each check returns a :class:`Check` (ok / warning / fail, the fix, the evidence);
nothing here prints. What talks to the outside world goes through the same
small functions as ``kvctl diagnose`` (engine ``/metrics``, Valkey via
kvctl.tier.admin, NVML, py-spy), so tests point them at real local components.
"""

from __future__ import annotations

import concurrent.futures
import importlib.metadata
import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvctl.connector.urls import INSTANCE_PLACEHOLDER, RANK_PLACEHOLDER, instances_in, redacted_repr
from kvctl.core import files, safeyaml
from kvctl.core.engine_http import EngineHttp
from kvctl.core.errors import ExitStatus, InvalidInput, KvctlError
from kvctl.core.thresholds import READ_TIMEOUT_S, RHO_HIGH, RHO_UNSTABLE, TIER_DIR
from kvctl.loading import edit as loading
from kvctl.loading import safety as loading_safety
from kvctl.ops.doctor_config import (lmcache_short_load_check, load_failure_policy_check, saved_diagnosis,
                                     sync_load_path_check, unknown_key_checks)
from kvctl.ops.doctor_engine import engine_checks
from kvctl.ops.doctor_host import check_nvml, check_py_spy
from kvctl.tier import checks as tier_checks
from kvctl.tier import server_checks
from kvctl.tier.check_types import InstanceRead
from kvctl.tier.checks import FAIL, OK, SKIPPED, WARNING, Check
from kvctl.tier.layout_checks import stored_groups_check
from kvctl.tier.lmcache_config import PLUGIN_MODULE, URL_LIST_KEY, plugin_key
from kvctl.tier.admin import PASSWORD_HINT, Admin, InstanceFailure, LoginRefused, NoPermission, TimedOut, Unanswered
from kvctl.tier.replies import BadReply
from kvctl.tier.sizing import up_command
from kvctl.tier.targets import Target

ORDER = (SKIPPED, OK, WARNING, FAIL)
#: LMCache releases whose native resp:// client has §5.4's bugs 1 and 2 and whose MLA store writes from rank 0 only
LMCACHE_BUGGY_UP_TO = (0, 5, 6)
KVCTL_MODULES = ("kvctl.plugins.vllm", "kvctl.plugins.lmcache_cpu", PLUGIN_MODULE)
#: Not --timeout (which bounds each engine or Valkey read): starting $KVCTL_LMCACHE_PYTHON, a local interpreter
#: whose first start (cold disk, .pyc compiles) takes seconds, to ask it for LMCache's version.
LMCACHE_VERSION_TIMEOUT_S = 60.0


#: What a doctor run that was given nothing of the deployment says (exit 6, never 0).
NOTHING_CHECKED = (
    f"nothing of the deployment was checked: give --engine-url, the tier (--dir, a tier in {TIER_DIR}, or --valkey) "
    "or the engine's config (--config, --kv-transfer-config)"
)


@dataclass(frozen=True)
class DoctorReport:
    checks: list[Check]
    worst: str
    nothing_checked: bool = False  # no engine, tier or config was given: only this host could be looked at
    unreachable: bool = False  # engines or instances were given and not one of them answered (each is a failed check)

    @property
    def exit_status(self) -> ExitStatus:
        """5 nothing given answered (no other failure), 4 a failure, 3 a warning, 6 nothing of the deployment checked, 0 all ok."""
        if self.unreachable and all(c.name in ("metrics", "up") for c in self.checks if c.status == FAIL):
            return ExitStatus.UNREACHABLE
        if self.worst not in (WARNING, FAIL) and self.nothing_checked:
            return ExitStatus.INSUFFICIENT_DATA
        return {WARNING: ExitStatus.FINDING_WARNING, FAIL: ExitStatus.FINDING_CRITICAL}.get(self.worst, ExitStatus.OK)


@dataclass(frozen=True)
class DoctorInput:
    __repr__ = redacted_repr  # URLs shown with their passwords masked (issue 44)
    engine_urls: tuple[str, ...] = ()
    targets: tuple[Target, ...] = ()
    lmcache_config: str | None = None
    kv_transfer_config: str | None = None  # JSON text, or @FILE
    world_size: int | None = None
    last_diagnosis: str | None = None  # kvctl diagnose --json output to use; None: the one saved for this tier (or engines)
    timeout_s: float = READ_TIMEOUT_S  # kvctl doctor --timeout and kvctl diagnose --timeout: one default
    host_checks: bool = True
    chunk_bytes: int | None = None  # one stored chunk; default: the largest of a few values sampled from the tier
    engines: int | None = None  # engines sharing the tier; default: the number of engine URLs, at least 1
    http: EngineHttp = field(default_factory=EngineHttp)  # engine credentials and the /metrics size cap
    stopped_tier: tuple[str, str] | None = None  # (dir, when): a tier `deploy-valkey down` stopped and left there


def run(inp: DoctorInput) -> DoctorReport:
    checks: list[Check] = []
    lmcache = _load_yaml(inp.lmcache_config) if inp.lmcache_config else None
    kvt = parse_kv_transfer_config(inp.kv_transfer_config) if inp.kv_transfer_config else None
    # every engine and instance read at once, each within its own --timeout: N silent sources cost one timeout, not N
    named = connector_of(kvt)  # the connector --kv-transfer-config names
    configured = named or ("lmcache" if lmcache is not None else None)  # the connector the configs name
    reads = _at_once([lambda u=u: _engine_alone(u, inp, configured) for u in inp.engine_urls] + [lambda t=t: _read_instance(t, inp) for t in inp.targets])
    engines, pre = [e for e, _ in reads[:len(inp.engine_urls)]], reads[len(inp.engine_urls):]
    checks.extend(c for _, said in reads[:len(inp.engine_urls)] for c in said)
    if not inp.engine_urls:
        checks.append(Check("engine", "metrics", SKIPPED, "no --engine-url given: engine, vLLM version and connector not checked"))
    if not inp.targets:
        checks.append(Check("valkey", "up", SKIPPED, f"no --dir, no --valkey and no tier in {TIER_DIR}: the Valkey tier was not checked") if not inp.stopped_tier
                      else Check("valkey", "up", SKIPPED, f"{inp.stopped_tier[0]} holds a tier `kvctl deploy-valkey down` stopped at {inp.stopped_tier[1]} "
                                 "(its files kept): not checked", f"start it with `kvctl deploy-valkey up --dir {inp.stopped_tier[0]}`, or name a running tier (--dir, --valkey)"))
    world = inp.world_size or next((e["ranks"] for e in engines if e.get("ranks")), None)
    block = next((e["block_size"] for e in engines if e.get("block_size")), None)
    threads = _valkey(inp, world, checks, pre)
    in_use = lmcache is not None or named == "lmcache" or any(e.get("connector") == "lmcache" for e in engines)
    _lmcache(lmcache, in_use, checks)
    kvctl_kvt = named == "kvctl"  # --kv-transfer-config names KvctlConnector
    checks.extend(unknown_key_checks(lmcache, inp.lmcache_config, kvt, kvctl_kvt))  # typos, with the key meant
    checks.extend(sync_load_path_check(kvt, kvctl_kvt))  # a step path vLLM's CUDA runner cannot undo
    checks.extend(load_failure_policy_check(kvt, named))  # vLLM's default fails a short load's request
    last = inp.last_diagnosis or saved_diagnosis(inp.targets, inp.engine_urls, lmcache, kvt)  # this tier's, never another's
    mode = _configs(lmcache, kvt, world, block, last, checks, inp.lmcache_config)
    checks.extend(lmcache_short_load_check(kvt, named, mode))  # LMCache's short sync load on vLLM's CUDA runner
    connections = server_checks.connections_check(kvt, lmcache, threads)  # the engine's connections against the io-threads read
    if connections is not None:
        checks.append(connections)
    stored = stored_groups_check(kvt, [k for x in pre if isinstance(x, InstanceRead) for k in x.sampled_keys])
    if stored is not None:  # the tier's chunks in this config's layer groups, or another engine's
        checks.append(stored)
    if inp.host_checks:
        checks.append(check_py_spy())
        checks.append(check_nvml())
    worst = max((c.status for c in checks if c.status != SKIPPED), key=ORDER.index, default=OK)
    nothing = not (inp.engine_urls or inp.targets or inp.lmcache_config or inp.kv_transfer_config)
    # refused or silent, each one: not an instance that answered something odd (BadReply) or refused a login
    silent = bool(inp.engine_urls or inp.targets) and all(e.get("unreachable") for e in engines) and all(isinstance(x, (TimedOut, Unanswered)) for x in pre)
    return DoctorReport(checks, worst, nothing, silent)


def _at_once(calls: list[Any]) -> list[Any]:  # each call bounded by its own deadline
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(calls))) as ex:
        return list(ex.map(lambda call: call(), calls))


def _engine_alone(url: str, inp: DoctorInput, configured: str | None) -> tuple[dict[str, Any], list[Check]]:
    said: list[Check] = []
    return engine_checks(url, inp.timeout_s, configured, said, inp.http), said


def _read_instance(t: Target, inp: DoctorInput) -> Any:  # an InstanceRead, or the InstanceFailure the read ended with
    try:
        with Admin(t.url, inp.timeout_s, password=t.password) as r:
            return tier_checks.read_instance(r, t.rank, t.host, t.port, t.instance, max((x.instances_per_rank for x in inp.targets), default=1))
    except InstanceFailure as e:
        return e


# --- inputs --------------------------------------------------------------------------------


def _load_yaml(path: str) -> dict[str, Any]:
    data = safeyaml.load(files.read_regular(path, "--config", newline=None), f"--config {path}")
    if not isinstance(data, dict):
        raise InvalidInput(f"--config {path} is not an LMCache config (a YAML mapping)")
    return data


def parse_kv_transfer_config(text: str) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` JSON, given inline or as ``@FILE`` (a regular file up to the config cap)."""
    if text.startswith("@"):
        text = files.read_regular(text[1:], "--kv-transfer-config", newline=None)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise InvalidInput(f"--kv-transfer-config is not JSON: {e}") from e
    if not isinstance(data, dict):
        raise InvalidInput("--kv-transfer-config must be a JSON object (vLLM's KVTransferConfig)")
    return data


def connector_of(kvt: dict[str, Any] | None) -> str | None:
    """kvctl, lmcache or None, from a KV transfer config."""
    if not kvt:
        return None
    if kvt.get("kv_connector_module_path") in KVCTL_MODULES or str(kvt.get("kv_connector", "")).startswith("Kvctl"):
        return "lmcache" if "LMCache" in str(kvt.get("kv_connector")) else "kvctl"
    return "lmcache" if "LMCache" in str(kvt.get("kv_connector", "")) else str(kvt.get("kv_connector") or "") or None


# --- Valkey --------------------------------------------------------------------------------


def _valkey(inp: DoctorInput, world: int | None, out: list[Check], pre: list[Any] | None = None) -> list[int]:
    """Each instance up (or auth), then its settings (kvctl.tier.checks, kvctl.tier.server_checks), then one instance per
    rank (or K per rank); returns the io-threads of every instance read. Each instance is read within one deadline of
    --timeout (connect, INFO, CONFIG GET, sampled key lengths), its replies typed (:mod:`kvctl.tier.admin`): a silent,
    dripping or odd instance is its own failed line."""
    reads: list[tier_checks.InstanceRead] = []
    up: dict[int, Check] = {}  # by tier number r*K + i
    k = max((t.instances_per_rank for t in inp.targets), default=1)
    pre = pre if pre is not None else _at_once([lambda t=t: _read_instance(t, inp) for t in inp.targets])  # read at once by run()
    for t, got in zip(inp.targets, pre):
        where = f"{t.name} ({t.host}:{t.port})"
        ident = {"rank": t.rank} if k == 1 else {"rank": t.rank, "instance": t.instance}
        try:
            if isinstance(got, InstanceFailure):
                raise got
            x = got
        except InstanceFailure as e:
            if isinstance(e, LoginRefused):
                out.append(Check("valkey", "auth", FAIL, f"{where} {e.reason}", PASSWORD_HINT, ident))
            elif isinstance(e, NoPermission):  # logged in, as a user that may not read the settings
                said = e.reason.split(": ", 1)[-1]  # the server's NOPERM text
                out.append(Check("valkey", "auth", FAIL, f"{where} up, but this user may not run INFO/CONFIG GET: {said}",
                                 "give doctor the tier's admin password (--password-file, or --dir of the tier), not the engines' user", ident))
            else:  # unreachable, timed out, or an answer that is not Valkey's
                fix = (f"is it stopped or hung? `kvctl diagnose stalls --pid PID` on its host (--timeout is {inp.timeout_s:g} s)" if isinstance(e, TimedOut)
                       else "point --valkey (or --dir) at a Valkey of the tier: something else answers there" if isinstance(e, BadReply)
                       else f"the tier in {inp.stopped_tier[0]} was stopped by `kvctl deploy-valkey down` at {inp.stopped_tier[1]}: "
                       f"`kvctl deploy-valkey up --dir {inp.stopped_tier[0]}` starts it again" if inp.stopped_tier
                       else "start it (kvctl deploy-valkey up) or fix the URL; kvctl deploy-valkey status shows every rank")
                out.append(Check("valkey", "up", FAIL, f"{where} {e.reason}", fix, ident))
            continue
        reads.append(x)
        up[x.key] = Check("valkey", "up", OK, f"{where} up, Valkey {x.info.get('valkey_version') or x.info.get('redis_version')}", evidence=ident)
    chunk, source = tier_checks.chunk_size(reads, inp.chunk_bytes)
    engines = inp.engines or max(1, len(inp.engine_urls))
    ctx = tier_checks.TierContext(
        chunk, source, engines, "--engines" if inp.engines else f"{len(inp.engine_urls)} --engine-url given" if inp.engine_urls else "assumed: give --engines",
        world, max(1, len(inp.targets)), tier_checks.host_cores(),
    )
    settings = tier_checks.tier_checks(reads, ctx)
    run_ids: dict[str, list[tier_checks.InstanceRead]] = {}
    for x in reads:
        run_ids.setdefault(str(x.info.get("run_id")), []).append(x)
        out.append(up[x.key])
        out.extend(settings[x.key])
    targets = inp.targets
    shared = {rid: xs for rid, xs in run_ids.items() if len(xs) > 1}
    if shared:
        for xs in shared.values():
            if k == 1:
                ranks = [x.rank for x in xs]
                out.append(Check("valkey", "one_per_rank", FAIL, f"ranks {', '.join(map(str, ranks))} reach the same Valkey server (same run_id): one instance serves several ranks", f"give every rank its own instance ({up_command('W', 1)}), paper §5.2", {"ranks": ranks}))
            else:
                names = [x.where for x in xs]
                out.append(Check("valkey", "one_per_rank", FAIL, f"{', '.join(names)} reach the same Valkey server (same run_id): one server stands for several instances",
                                 f"give every instance its own server ({up_command('W', k)})",
                                 {"instances": [[x.rank, x.instance] for x in xs]}))
    elif targets and world and len(targets) != world * k:
        want = f"{world} ranks" if k == 1 else f"{world} ranks × {k} instances per rank"
        fix = up_command(world, k) + (": one instance per rank" if k == 1 else "")
        out.append(Check("valkey", "one_per_rank", FAIL, f"{len(targets)} Valkey instance(s) for {want}", fix,
                         {"instances": len(targets), "world_size": world, **({"instances_per_rank": k} if k > 1 else {})}))
    elif targets and run_ids:
        per = "one per rank" if k == 1 else f"{k} per rank"
        out.append(Check("valkey", "one_per_rank", OK, f"{len(targets)} distinct instance(s), {per}" + (f" ({world} ranks)" if world else ""),
                         evidence={"instances": len(targets), **({"instances_per_rank": k} if k > 1 else {})}))
    return [server_checks.instance_io_threads(x) for x in reads]


# --- LMCache -------------------------------------------------------------------------------


def lmcache_version() -> str | None:
    """Installed LMCache (this interpreter, else $KVCTL_LMCACHE_PYTHON's), or None."""
    try:
        return importlib.metadata.version("lmcache")
    except importlib.metadata.PackageNotFoundError:
        pass
    other = os.environ.get("KVCTL_LMCACHE_PYTHON")
    if other and Path(other).exists():
        try:
            res = subprocess.run([other, "-c", "import importlib.metadata as m; print(m.version('lmcache'))"], capture_output=True, text=True, timeout=LMCACHE_VERSION_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):  # one slow interpreter must not abort the whole checklist
            return None
        if res.returncode == 0 and res.stdout.strip():
            return res.stdout.strip()
    return None


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def _uses_plugin(lmc: dict[str, Any] | None) -> bool:
    return bool(lmc and lmc.get("remote_storage_plugins"))


def _lmcache(lmc: dict[str, Any] | None, in_use: bool, out: list[Check]) -> None:
    version = lmcache_version()
    if version is None:
        out.append(Check("lmcache", "installed", SKIPPED, "LMCache not installed here: not checked", evidence={"version": None}))
        return
    buggy = _version_tuple(version) <= LMCACHE_BUGGY_UP_TO
    native = bool(lmc and lmc.get("remote_url") and not _uses_plugin(lmc))
    if not buggy:
        out.append(Check("lmcache", "installed", OK, f"LMCache {version}", evidence={"version": version}))
        return
    bugs = "its native resp:// client hangs on a GET of a missing key and can lose a completion (paper §5.4, bugs 1 and 2)"
    fix = f"use kvctl's remote-storage plugin ({PLUGIN_MODULE}: kvctl deploy-valkey lmcache-config --plugin prints the config)"
    if native:
        out.append(Check("lmcache", "known_bugs", FAIL, f"LMCache {version} with remote_url {lmc['remote_url']}: {bugs}", fix, {"version": version}))
    elif _uses_plugin(lmc):
        out.append(Check("lmcache", "known_bugs", OK, f"LMCache {version}: its native client's bugs are bypassed by the remote-storage plugin", evidence={"version": version}))
    else:
        out.append(Check("lmcache", "known_bugs", WARNING, f"LMCache {version} installed: {bugs}", fix + "; give --config to check the engine's config", {"version": version}))
    out.append(Check(
        "lmcache", "mla_pcp", WARNING if in_use else OK,
        f"LMCache {version} stores MLA KV from rank 0 only: under prefill context parallelism one rank writes and loads the whole prompt"
        + ("" if in_use else " (LMCache is not in use here)"),
        "for MLA with PCP use kvctl's sharded store (kvctl.plugins.vllm KvctlConnector), every rank its own chunks", {"version": version},
    ))


# --- config mismatches ---------------------------------------------------------------------


def _configs(
    lmc: dict[str, Any] | None, kvt: dict[str, Any] | None, world: int | None, block: int | None, last: str | None, out: list[Check], lmc_path: str | None = None,
) -> str | None:
    """The configs' checks into ``out``; returns the loading mode they configure (:func:`_loading_mode`)."""
    extra_kvt = (kvt or {}).get("kv_connector_extra_config") or {}
    extra_lmc = (lmc or {}).get("extra_config") or {}
    if lmc is not None:
        if lmc.get("remote_url") and _uses_plugin(lmc):
            out.append(Check("config", "double_writes", FAIL, f"LMCache remote_url ({lmc['remote_url']}) next to remote_storage_plugins {lmc['remote_storage_plugins']}: LMCache builds two remote backends and writes every chunk twice", "drop remote_url; the plugin's URL lives in extra_config", {}))
        else:
            out.append(Check("config", "double_writes", OK, "one remote backend configured"))
    chunk, chunk_key = None, None
    if lmc is not None and lmc.get("chunk_size") is not None:
        chunk, chunk_key = lmc.get("chunk_size"), "LMCache chunk_size"
    elif extra_kvt.get("chunk_tokens") is not None:
        chunk, chunk_key = extra_kvt.get("chunk_tokens"), "kv_connector_extra_config.chunk_tokens"
    if chunk is not None and block:
        if isinstance(chunk, int) and chunk > 0 and chunk % block == 0:
            out.append(Check("config", "chunk_vs_block", OK, f"{chunk_key} {chunk} is a multiple of vLLM's block size {block}"))
        else:
            out.append(Check("config", "chunk_vs_block", FAIL, f"{chunk_key} {chunk} is not a multiple of vLLM's block size {block}: chunks straddle blocks and partial chunks are never stored", f"set {chunk_key} to a multiple of {block} (e.g. {block * max(1, round((chunk if isinstance(chunk, int) else block) / block))})", {"chunk": chunk, "block_size": block}))
    urls = extra_kvt.get("urls") or extra_lmc.get(URL_LIST_KEY)
    k_kvt, k_lmc = extra_kvt.get("instances_per_rank"), extra_lmc.get(plugin_key("instances_per_rank"))
    urls_k = k_kvt if extra_kvt.get("urls") else k_lmc
    # (template, the instances per rank its config declares): the connector's url, the plugin's, LMCache's own remote_url
    templates = list(dict.fromkeys(
        (u, k) for u, k in ((extra_kvt.get("url"), k_kvt), (extra_lmc.get(plugin_key("url")), k_lmc), ((lmc or {}).get("remote_url"), None))
        if isinstance(u, str) and (RANK_PLACEHOLDER in u or INSTANCE_PLACEHOLDER in u)))
    if isinstance(urls, list):
        _instances_listed(urls, urls_k, out)
    if isinstance(urls, list) and world:
        if len(urls) == world:
            listed = _listed_k(urls)
            out.append(Check("config", "urls_vs_world_size", OK, f"{len(urls)} per-rank URLs for {world} ranks"
                             + (f", {listed} instances each" if listed and listed > 1 else "")))
        else:
            out.append(Check("config", "urls_vs_world_size", FAIL, f"{len(urls)} per-rank URLs for {world} ranks: ranks past the list have no instance, or instances sit idle", f"list exactly {world} URLs (kvctl deploy-valkey vllm-config --dir TIER prints them)", {"urls": len(urls), "world_size": world}))
    if isinstance(urls, list) and not world:
        out.append(Check("config", "urls_vs_world_size", WARNING, f"{len(urls)} per-rank URLs, but the number of ranks is unknown: cannot check one URL per rank", "give --world-size (or --engine-url of an engine exporting kvctl:ranks)", {"urls": len(urls)}))
    for t, k in templates:
        native = lmc is not None and t == lmc.get("remote_url") and not _uses_plugin(lmc) and connector_of(kvt) != "kvctl"
        k = k if isinstance(k, int) and not isinstance(k, bool) else 1
        if native:
            out.append(Check("config", "rank_template", FAIL, f"remote_url {t} has {RANK_PLACEHOLDER} but nothing replaces it: stock LMCache connects to the literal host", f"use kvctl's plugin (remote_storage_plugins: [kvctl], extra_config {plugin_key('url')}: {t}) or extra_config.{URL_LIST_KEY}", {"url": t}))
        elif (INSTANCE_PLACEHOLDER in t) != (k > 1):
            why = (f"has {INSTANCE_PLACEHOLDER} but says no instances_per_rank above 1: kvctl's connector refuses it, its LMCache plugin puts every chunk on instance 0"
                   if k == 1 else f"says {k} instances per rank but has no {INSTANCE_PLACEHOLDER}: every instance of a rank would be the same URL (both readers refuse it)")
            fix = (f"give instances_per_rank K next to it (kv_connector_extra_config.instances_per_rank, extra_config.{plugin_key('instances_per_rank')}), "
                   f"or print the config with `kvctl deploy-valkey vllm-config|lmcache-config --instances-per-rank K`")
            out.append(Check("config", "rank_template", FAIL, f"{t} {why}", fix, {"url": t, "instances_per_rank": k}))
        elif RANK_PLACEHOLDER not in t:
            out.append(Check("config", "rank_template", WARNING, f"{t} has {INSTANCE_PLACEHOLDER} but no {RANK_PLACEHOLDER}: every rank uses the same {k} instances",
                             f"add {RANK_PLACEHOLDER} (resp://valkey-{{rank}}-{{instance}}:6379): a rank's chunks belong on its own instances", {"url": t}))
        elif world is None:
            out.append(Check("config", "rank_template", WARNING, f"{t} is a {RANK_PLACEHOLDER} template but the number of ranks is unknown: cannot check that instances 0..W-1 exist", "give --world-size (or --engine-url of an engine exporting kvctl:ranks)", {"url": t}))
        elif k > 1:
            out.append(Check("config", "rank_template", OK, f"{t} expands to {world} ranks × {k} instances = {world * k} URLs",
                             evidence={"url": t, "instances_per_rank": k}))
        else:
            out.append(Check("config", "rank_template", OK, f"{t} expands to {world} per-rank URLs"))
    return _loading_vs_rho(lmc_path, lmc, extra_kvt, last, out)


def _listed_k(urls: list[Any]) -> int | None:
    """K as a per-rank URL list spells it (every entry one URL, or a list of the same length), None when it does not."""
    try:
        return instances_in(urls)
    except InvalidInput:
        return None


def _instances_listed(urls: list[Any], declared: Any, out: list[Check]) -> None:
    """A per-rank list of lists: every rank the same number of URLs, the number its config declares (no line for plain lists)."""
    listed = _listed_k(urls)
    if listed == 1 and declared in (None, 1):
        return
    if listed is None:
        out.append(Check("config", "instances_per_rank", FAIL, "the per-rank URL list gives its ranks different numbers of instances: both readers refuse it",
                         "list K URLs for every rank (kvctl deploy-valkey vllm-config|lmcache-config prints them)", {}))
    elif declared is not None and declared != listed:
        out.append(Check("config", "instances_per_rank", FAIL, f"instances_per_rank {declared}, but every rank lists {listed} URL(s): the engine refuses to start",
                         f"set instances_per_rank {listed}, or list {declared} URLs per rank", {"declared": declared, "listed": listed}))
    else:
        out.append(Check("config", "instances_per_rank", OK, f"{listed} instances per rank, each with its own URL", evidence={"instances_per_rank": listed}))


def _loading_mode(lmc_path: str | None, lmc: dict[str, Any] | None, extra_kvt: dict[str, Any], out: list[Check]) -> str | None:
    """"sync", "async", None (not configured here), or "" after a failed check (a setting that is neither)."""
    if lmc is not None and loading.KEY in lmc and lmc_path:
        try:  # read as `kvctl loading` reads it: LMCache takes the string "false" as false
            st = loading.yaml_state(lmc_path)
        except KvctlError as e:
            msg = str(e).removesuffix("; the file was not changed")
            out.append(Check("config", "loading_vs_rho", FAIL, f"{msg}: the loading mode is unclear", f"write {loading.KEY}: true or false", {}))
            return ""
        return "async" if st.async_loading else "sync"
    if "async_loading" in extra_kvt:
        value = extra_kvt["async_loading"]
        if not isinstance(value, bool):
            out.append(Check(
                "config", "loading_vs_rho", FAIL,
                f"kv_connector_extra_config.async_loading is {value!r}, not true or false: kvctl's connector refuses it and the engine does not start",
                'write "async_loading": true or false (JSON booleans, unquoted)', {"async_loading": value},
            ))
            return ""
        return "async" if value else "sync"
    return None


def _loading_vs_rho(lmc_path: str | None, lmc: dict[str, Any] | None, extra_kvt: dict[str, Any], last: str | None, out: list[Check]) -> str | None:
    """The loading mode against the saved diagnosis, judged as `kvctl loading sync` judges it (kvctl.loading.safety.judge_sync);
    returns the mode (:func:`_loading_mode`)."""
    mode = _loading_mode(lmc_path, lmc, extra_kvt, out)
    if not mode:
        return mode
    try:
        diagnosis, source = loading_safety.load_diagnosis(None, Path(last)) if last else (None, None)
    except KvctlError as e:
        out.append(Check("config", "loading_vs_rho", WARNING, f"{mode} loading; {e}", "run kvctl diagnose again", {}))
        return mode
    if diagnosis is None:
        out.append(Check("config", "loading_vs_rho", OK, f"{mode} loading; no saved diagnosis of this tier with ρ to compare (run kvctl diagnose on it)"))
        return mode
    v = loading_safety.judge_sync(diagnosis, source)
    ev = {"rho": v.rho, "lower_bound": v.lower_bound, "diagnosis": source, "taken": v.saved_at}
    shown = "ρ unknown" if v.rho is None else f"ρ {'≥' if v.lower_bound else '='} {v.rho:.2f}"
    if mode == "async":
        out.append(Check("config", "loading_vs_rho", OK, f"async loading at {shown} (diagnosis of {v.saved_at})", evidence=ev))
    elif not v.problems:
        out.append(Check("config", "loading_vs_rho", OK, f"synchronous loading at {shown} < {RHO_HIGH:g} (diagnosis of {v.saved_at})", evidence=ev))
    elif v.rho is not None and v.rho >= RHO_UNSTABLE and not v.stale:
        out.append(Check("config", "loading_vs_rho", FAIL, f"synchronous loading at {shown} (diagnosis of {v.saved_at}): the load queue is unstable", f"kvctl loading async --config LMCACHE_YAML, then add instances ({up_command()})", ev))
    elif v.rho is not None and v.rho >= RHO_HIGH and not v.stale:
        out.append(Check("config", "loading_vs_rho", WARNING, f"synchronous loading at {shown} ≥ {RHO_HIGH:g} (diagnosis of {v.saved_at}): close to saturation", "add instances, or switch with kvctl loading async", ev))
    else:
        out.append(Check(
            "config", "loading_vs_rho", WARNING, "synchronous loading, which the saved diagnosis cannot clear: " + "; ".join(v.problems),
            "measure ρ now with engine-side metrics (kvctl diagnose --engine-url ENGINE), or switch with kvctl loading async", ev,
        ))
    return mode

