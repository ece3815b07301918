"""The one fix line of each finding (issue 48 item 3): what the findings table, stderr, the runbook and the drill say.

:func:`fix_line` takes a finding's numbers (the instances that bring ρ to its target, the target, the engines that
share an instance) and the deployment (:class:`Deployment`: the engine's ranks W, the instances per rank K, each
instance's server version and io-threads) and returns the line ``kvctl diagnose`` prints as the finding's fix.
Without numbers it returns the line's template, placeholders and all (:data:`PLACEHOLDERS` says what each stands
for): every runbook's Fix section quotes its finding's templates word for word (tests/diagnose/test_fixes.py), so the
page shows the command form the finding prints. A stall finding's fix is the stall classifier's
(:data:`kvctl.diagnose.stalls.RECOMMENDATIONS`), returned here as it is.

The server change comes first, before any instance is added (:func:`kvctl.tier.sizing.first_step`, issue 45), and
instances are always said as W ranks × K per rank with the one command form (:func:`kvctl.tier.sizing.up_command`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from kvctl.core.runbooks import runbook_for
from kvctl.diagnose.stalls import RECOMMENDATIONS
from kvctl.tier.sizing import FirstStep, first_step, up_command

#: what each placeholder of a template stands for (the runbooks explain them with these words)
PLACEHOLDERS = {
    "STEP": "the server change that gives each instance more before any is added (Valkey 8.x → 9.1, io-threads to "
            "the host's share), said only when one is due (kvctl doctor's server_version and io_threads lines say it too)",
    "N": "instances of the bandwidth measured that bring ρ to the target (instances_for_rho_target in the evidence)",
    "T": "the target ρ (0.5, RHO_TARGET in kvctl/core/thresholds.py)",
    "W": "the engine's ranks (TP × PCP: its kvctl:ranks, else the tier's ranks)",
    "K": "instances per rank, ⌈N/W⌉",
    "E": "the engines that share the instance",
}

#: the finding ids whose fix may start with the server change
STEP_FIRST = ("rho_high", "rho_unstable", "bandwidth_below_breakeven", "instance_saturated", "hits_recomputed")

#: the finding ids whose fix line is built from the finding's numbers and the deployment (one form each)
NUMBERED = ("rho_high", "rho_unstable", "instance_saturated", "hits_recomputed")

#: fix lines without numbers, by finding id (a finding with two forms has a key per form)
STATIC = {
    "bandwidth_below_breakeven": "raise the tier's bandwidth: one Valkey instance per rank scales GETs (6.3× at 8 "
                                 "instances in the paper); until B > B*, hits only save GPU compute",
    "prompt_below_min_hit": "keep the tier for capacity (hits use no GPU compute); to win on latency, shrink T0 "
                            "(engine-side per-hit cost) — see `kvctl cost report`",
    "queue_growing_gpu_idle": "the remote tier or a stalled lookup is holding the engine step: check ρ above, run "
                              "`kvctl diagnose stalls --match vllm`, consider `kvctl loading async`",
    "queue_growing:gpu_unknown": "run kvctl where NVML sees the engine's GPUs to tell a compute-bound engine from one "
                                 "waiting on the tier; check ρ and `kvctl diagnose stalls`",
    "queue_growing:compute_bound": "add prefill capacity, or raise the hit fraction so fewer tokens are recomputed",
    "hot_instance": "keys are not spread by rank: use the {rank} URL so each rank's chunks live on its own instance "
                    "(sharded store, paper §5.2)",
    "evictions_under_load": "raise maxmemory or add instances (`kvctl deploy-valkey`); check that maxmemory-policy is "
                            "an LRU policy",
    "timeouts_rising": "lookups or blocking GETs are timing out: check the remote tier's latency (kvctl bench), run "
                       "`kvctl diagnose stalls` for the lost-completion and missing-key signatures",
    "metrics_too_large": "check that --engine-url is vLLM's API server (not a proxy or a sidecar that streams); if the "
                         "engine really exports that much, raise --max-metrics-bytes",
    "l2_no_hits": "check the connector's logs and its remote URL, that the tier holds this model's keys (same key "
                  "format, PYTHONHASHSEED fixed for LMCache), and run `kvctl diagnose stalls --match vllm`",
    "prefill_rate_implausible": "find what the prefill waits on (`kvctl diagnose stalls`); give --prefill-rate "
                                "measured on a healthy engine for B* and n*",
    "bandwidth_implausible": "check the engine's /metrics by hand (kvctl:l2_get_*, lmcache:remote_time_to_get in ms); "
                             "give the tier (--valkey) for a server-side bound",
    "engine_restarted": "its rates count only from the restart; run the diagnosis again over a window without a restart",
    "load_failures": "failed or disagreeing ranks shorten the agreed prefix and turn hits into recompute: check the "
                     "tier with `kvctl deploy-valkey status` and every rank's remote URL",
    "saves_dropped": "measure what the tier takes (`kvctl bench`) against the engines' save rate; add instances per rank "
                     "(`kvctl deploy-valkey up --instances-per-rank`), or raise the connector's save_queue_bytes where the "
                     "GPU has the memory",
}


@dataclass(frozen=True)
class Server:
    """One instance as a fix needs it: its server version and io-threads, and its host (cores None: another host,
    whose cores are not known here; a 16-core one is assumed, and said)."""

    version: str | None
    io_threads: int | None
    cores: int | None = None
    instances_on_host: int = 1


@dataclass(frozen=True)
class Deployment:
    """What a fix is said for: the engine's ranks W (None: unknown, said ``W``), the instances per rank now, and the
    instances' servers."""

    ranks: int | None = None
    instances_per_rank: int = 1
    servers: tuple[Server, ...] = ()

    def first_step(self) -> FirstStep | None:
        """The server change that gives an instance the most (kvctl.tier.sizing.first_step); None when none is due."""
        steps = [first_step(s.version, s.io_threads, s.cores, s.instances_on_host) for s in self.servers]
        steps = [s for s in steps if s is not None]
        return max(steps, key=lambda s: s.then_gbps / s.now_gbps) if steps else None


def templates(finding_id: str) -> list[str]:
    """Every form of a finding's fix line, placeholders and all (what its runbook quotes); [] for an id without one."""
    if finding_id in RECOMMENDATIONS or finding_id in ALERTS or finding_id in NUMBERED:
        return [fix_line(finding_id)]
    return [fix_line(finding_id, variant=k.partition(":")[2] or None) for k in STATIC if k.partition(":")[0] == finding_id]


def fix_line(finding_id: str, numbers: Mapping[str, Any] | None = None, deployment: Deployment | None = None,
             variant: str | None = None) -> str:
    """The fix of ``finding_id`` with ``numbers`` and ``deployment`` filled in; its template without ``numbers``.

    ``numbers``: ``instances_for_rho_target`` and ``rho_target`` (rho_*), ``engines`` (instance_saturated).
    ``variant``: which form of a finding with two (queue_growing: ``gpu_unknown`` or ``compute_bound``)."""
    if finding_id in RECOMMENDATIONS:
        return RECOMMENDATIONS[finding_id]
    if finding_id in ALERTS:
        return ALERTS[finding_id](deployment or Deployment())
    dep = deployment or Deployment()
    first = _first(dep, template=numbers is None) if finding_id in STEP_FIRST else ""
    if finding_id in ("rho_high", "rho_unstable"):
        return first + _more_instances(numbers, dep)
    if finding_id == "instance_saturated":
        return first + _shared(numbers, dep)
    if finding_id == "hits_recomputed":
        return first + _recomputed(numbers, dep)
    key = f"{finding_id}:{variant}" if variant else finding_id
    if key not in STATIC:
        raise KeyError(f"no fix line for {key}")
    return first + STATIC[key]


def _first(dep: Deployment, template: bool) -> str:
    if template:
        return "first, before adding instances: STEP; then "
    step = dep.first_step()
    return f"first, before adding instances: {step.text}; then " if step else ""


def _layout(n: int | None, dep: Deployment) -> tuple[str, str, str, str]:
    """(N, W, K, what to add): numbers where known, placeholders where not."""
    if n is None:
        return "N", str(dep.ranks) if dep.ranks else "W", "K", ""
    if not dep.ranks:
        return str(n), "W", "K", f", K = ⌈{n}/W⌉"
    w = dep.ranks
    k = max(1, math.ceil(n / w))
    return str(n), str(w), str(k), (f", {w * k} in all" if w * k != n else "")


def _more_instances(numbers: Mapping[str, Any] | None, dep: Deployment) -> str:
    n, w, k, extra = _layout(None if numbers is None else numbers.get("instances_for_rho_target"), dep)
    target = "T" if numbers is None else f"{numbers.get('rho_target'):g}"
    return (f"run {n} Valkey instance(s) of this bandwidth to bring ρ to ≤ {target}: {k} per rank on the engine's {w} "
            f"rank(s){extra} (`{up_command(w, k)}`), or switch to asynchronous loading (`kvctl loading async`)")


def _shared(numbers: Mapping[str, Any] | None, dep: Deployment) -> str:
    e = "E" if numbers is None else str(numbers.get("engines") or "E")
    w = "W" if numbers is None or not dep.ranks else str(dep.ranks)
    return (f"add instances for the {e} engines that share this tier: `kvctl plan --engines {e} --ranks {w}` finds K, "
            f"the instances per rank, then `{up_command(w, 'K')}`; or give the busiest engine its own tier")


def _recomputed(numbers: Mapping[str, Any] | None, dep: Deployment) -> str:
    w = "W" if numbers is None or not dep.ranks else str(dep.ranks)
    return (f"give the tier the capacity its hits need: `kvctl plan --ranks {w} --policy on` sizes it with the decision "
            f"(K, the instances per rank), then `{up_command(w, 'K')}`; until then the decision keeps these prompts at "
            "recompute speed, nothing to flip")


def _instance_down(dep: Deployment) -> str:
    w = str(dep.ranks) if dep.ranks else "W"
    k = str(dep.instances_per_rank) if dep.ranks else "K"
    return (f"restart or replace the instance that does not answer (`kvctl deploy-valkey status --dir ./kv-tier` names it; "
            f"a local tier: `{up_command(w, k)} --dir ./kv-tier`); its chunks are recomputed meanwhile")


#: fixes of alerts that are not a finding of diagnose (the drill's dead instance)
ALERTS = {"instance_down": _instance_down}


@dataclass(frozen=True)
class Verdict:
    """What diagnose says first (issue 48): the worst finding's one-line verdict, its one fix and its runbook, or
    that nothing needs fixing. ``severity``: the worst finding's, or "ok"; ``finding``: its id (None: no finding)."""

    severity: str
    finding: str | None
    headline: str
    fix: str | None
    runbook: str | None


def verdict(findings: Sequence[Any], rho: float | None = None, unreachable: bool = False,
            rho_lower_bound: bool = False) -> Verdict:
    """The verdict over a diagnosis' findings (ids, severities, messages and fixes as the rules wrote them): the
    first finding of the worst severity, its fix line and its runbook command; else whether anything was seen
    (a ρ that is only a lower bound, from Valkey's server-side time, says nothing of keeping up)."""
    order = ("info", "warning", "critical")
    worst = max(findings, key=lambda f: order.index(f.severity) if f.severity in order else -1, default=None)
    if worst is not None:
        return Verdict(worst.severity, worst.id, f"{worst.id}: {worst.message}", worst.recommendation, runbook_for(worst.id))
    if unreachable:
        return Verdict("unknown", None, "no source answered: nothing was judged", None, None)
    if rho is not None and rho_lower_bound:
        return Verdict("ok", None, f"no finding from these samples: ρ ≥ {rho:.2f} is only a lower bound here (see the "
                                   "notes)", None, None)
    tail = f": ρ = {rho:.2f}, the tier keeps up with this load" if rho is not None else ""
    return Verdict("ok", None, f"no finding{tail}", None, None)
