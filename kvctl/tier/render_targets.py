"""Fleet targets: one Valkey per rank (or K per rank) as a systemd template unit, or a k8s StatefulSet.

K instances per rank: instance ``i`` of rank ``r`` is number ``n = r*K + i`` of the tier
(:func:`kvctl.connector.urls.flat_instance`). systemd: the same template unit, instance name
``<r>-<i>`` (``NAME@0-1``, config ``NAME-0-1.conf``, port ``base_port + n``); with K = 1 the
instance name is the rank, as before. k8s: one StatefulSet of W × K replicas, pod ordinal ``n``
(``NAME-<n>.SERVICE``): a StatefulSet numbers its pods 0 … replicas-1 and nothing else, so the engine
configs list the hosts (a ``{rank}``/``{instance}`` template cannot spell ``r*K + i``).

Both target Valkey 9.1 (k8s: the ``valkey/valkey:9.1`` image; systemd: the host's ``/usr/bin/valkey-server``, which
must be 9.x: 8.x refuses the copy-free reply's directive). io-threads: ``--io-threads``, else
:func:`kvctl.tier.sizing.io_threads_for` on a host of ``--host-cores`` cores (kvctl cannot see that host) shared by
the tier's W × K instances (systemd: they all run on ``--host``; k8s: the same rule, the pods assumed to share a
node, each requesting its io-threads in CPUs); a 9.x server also gets ``min-io-threads-avoid-copy-reply`` at those
threads (:func:`kvctl.tier.sizing.zero_copy_settings`; for k8s the image's tag says the version, and a tag that is
no 9.x version gets no such directive).

Rendering is pure (returns :class:`RenderedFile` objects); :func:`write_files`
writes them (secrets mode 0600) and :func:`apply` is the only step that
changes a machine or a cluster, run only on ``--apply``.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from kvctl.connector.urls import MAX_INSTANCES_PER_RANK, flat_instance
from kvctl.core.errors import BinaryNotFound, InvalidInput, KvctlError
from kvctl.core.files import write_atomic
from kvctl.core.thresholds import FLEET_HOST_CORES, RECOMMENDED_VALKEY
from kvctl.tier import sizing, spec
from kvctl.tier.server import render_config

K8S_AUTH_DIR = "/etc/valkey-auth"
K8S_CONF_DIR = "/etc/valkey"
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MIB = 1024**2
#: uid/gid of the valkey user in the official image; fsGroup makes the Secret and /data readable to it.
VALKEY_UID = 999


class _Dumper(yaml.SafeDumper):
    """Block literals for multi-line strings (configs), no anchors/aliases."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def _str_presenter(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str_presenter)


@dataclass(frozen=True)
class RenderedFile:
    name: str  # relative to --out
    text: str
    secret: bool = False


@dataclass(frozen=True)
class FleetSpec:
    target: str
    ranks: int
    maxmemory_per_instance: int
    io_threads: int
    base_port: int
    host: str
    k8s_port: int
    auth: spec.Auth
    engine_password: str | None = field(repr=False)
    name: str
    service: str
    namespace: str | None
    image: str
    instances_per_rank: int = 1
    host_cores: int = FLEET_HOST_CORES

    @property
    def instances(self) -> int:
        return self.ranks * self.instances_per_rank

    @property
    def server_version(self) -> object:
        """The Valkey the rendering targets: the k8s image's tag, RECOMMENDED_VALKEY for systemd."""
        return self.image if self.target == "k8s" else RECOMMENDED_VALKEY

    def unit_instances(self) -> list[tuple[int, int, str]]:
        """(rank, instance, systemd instance name) of every instance in tier order: ``<r>`` when K is 1, else ``<r>-<i>``."""
        k = self.instances_per_rank
        return [(r, i, str(r) if k == 1 else f"{r}-{i}") for r in range(self.ranks) for i in range(k)]

    @classmethod
    def build(
        cls,
        target: str,
        ranks: int,
        maxmemory: str | int,
        io_threads: int | None,
        base_port: int,
        host: str,
        k8s_port: int,
        password_file: str | None,
        insecure_no_auth: bool,
        name: str,
        service: str | None,
        namespace: str | None,
        image: str,
        instances_per_rank: int = 1,
        host_cores: int = FLEET_HOST_CORES,
    ) -> "FleetSpec":
        """Validate the options of a fleet target (names, ports, sizes, the password rule)."""
        if host_cores < 1:
            raise InvalidInput(f"--host-cores must be at least 1, got {host_cores}")
        if ranks < 1:
            raise InvalidInput(f"--ranks must be at least 1, got {ranks}")
        if not 1 <= instances_per_rank <= MAX_INSTANCES_PER_RANK:
            raise InvalidInput(f"--instances-per-rank must be in 1..{MAX_INSTANCES_PER_RANK}, got {instances_per_rank}")
        n = ranks * instances_per_rank
        service = service or name
        # every value that reaches a rendered file: no control character (a newline would add a directive or a line)
        spec.check_host(host)
        spec.check_text(image, "--image")
        if not image or any(c.isspace() for c in image):
            raise InvalidInput(f"--image {image!r} is not an image reference (no spaces)")
        for label, value in (("--name", name), ("--service", service), ("--namespace", namespace)):
            if value is not None and (not _DNS_LABEL.match(value) or len(value) > 50):
                raise InvalidInput(f"{label} {value!r} must be a DNS label: lowercase letters, digits and '-', at most 50 characters")
        if target == "systemd" and base_port + n - 1 > 65535:
            raise InvalidInput(f"ports {base_port}..{base_port + n - 1} are outside 1..65535")
        per = spec.split_maxmemory(maxmemory, ranks, instances_per_rank)
        # pods listen on all interfaces; systemd instances on --host
        auth = spec.resolve_auth("0.0.0.0" if target == "k8s" else host, password_file, insecure_no_auth)
        return cls(
            target=target,
            ranks=ranks,
            maxmemory_per_instance=per,
            io_threads=io_threads or sizing.io_threads_for(host_cores, n),
            base_port=base_port,
            host=host,
            k8s_port=k8s_port,
            auth=auth,
            engine_password=spec.new_engine_password() if auth.enabled else None,
            name=name,
            service=service,
            namespace=namespace,
            image=image,
            instances_per_rank=instances_per_rank,
            host_cores=host_cores,
        )


def remote_urls(fleet: FleetSpec) -> str | list[str] | list[list[str]]:
    """k8s: the ``{rank}`` template over the headless Service; systemd: one URL per port.

    K > 1 instances per rank: per rank, the list of its K URLs (``[[r0i0, r0i1, …], [r1i0, …], …]``),
    instance i of rank r on port ``base_port + r*K + i`` (systemd) or pod ``NAME-<r*K + i>`` (k8s).
    """
    k = fleet.instances_per_rank
    if fleet.target == "k8s":
        domain = f"{fleet.service}.{fleet.namespace}.svc" if fleet.namespace else fleet.service
        if k == 1:
            return f"resp://{fleet.name}-{{rank}}.{domain}:{fleet.k8s_port}"
        return [[f"resp://{fleet.name}-{flat_instance(r, i, k)}.{domain}:{fleet.k8s_port}" for i in range(k)] for r in range(fleet.ranks)]
    if k == 1:
        return [f"resp://{fleet.host}:{fleet.base_port + r}" for r in range(fleet.ranks)]
    return [[f"resp://{fleet.host}:{fleet.base_port + flat_instance(r, i, k)}" for i in range(k)] for r in range(fleet.ranks)]


def memory_limit_bytes(maxmemory: int) -> int:
    """Container/unit memory limit above maxmemory: +25 % (at least 64 MiB) for buffers and fragmentation, rounded up to whole MiB."""
    return math.ceil((maxmemory + max(64 * MIB, maxmemory // 4)) / MIB) * MIB


# ----------------------------------------------------------------------------- systemd


def render_systemd(fleet: FleetSpec) -> list[RenderedFile]:
    """``NAME@.service`` (instance = rank, or ``<rank>-<instance>``) and ``NAME-<instance>.conf`` per instance, for /etc/NAME/."""
    n = fleet.name
    k = fleet.instances_per_rank
    what = "rank %i" if k == 1 else "rank-instance %i"
    unit = f"""[Unit]
Description=Valkey KV-cache tier {n}, {what} (kvctl deploy-valkey)
Documentation=https://valkey.io/topics/
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
User=valkey
Group=valkey
ExecStart=/usr/bin/valkey-server /etc/{n}/{n}-%i.conf
StateDirectory={n}/%i
RuntimeDirectory={n}-%i
Restart=on-failure
RestartSec=2
LimitNOFILE=65536
MemoryMax={memory_limit_bytes(fleet.maxmemory_per_instance)}
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes

[Install]
WantedBy=multi-user.target
"""
    files = [RenderedFile(f"{n}@.service", unit)]
    for r, i, unit_instance in fleet.unit_instances():
        conf: dict[str, object] = {
            "port": fleet.base_port + flat_instance(r, i, k),
            "bind": fleet.host,
            "daemonize": "no",
            "dir": f"/var/lib/{n}/{unit_instance}",
            "pidfile": f"/run/{n}-{unit_instance}/valkey.pid",
            "logfile": "",  # stdout: journald
        }
        conf.update(spec.cache_settings(fleet.maxmemory_per_instance, fleet.io_threads, fleet.auth, fleet.engine_password,
                                        version=fleet.server_version))
        if k == 1:
            header = f"# {n} rank {r}: instance r holds exactly rank r's chunks (kvctl deploy-valkey --target systemd)\n"
        else:
            header = (f"# {n} rank {r} instance {i} (unit {n}@{unit_instance}): rank {r}'s chunks c with (c // W) mod {k} == {i} "
                      "(kvctl deploy-valkey --target systemd)\n")
        header += (f"# for Valkey 9.x (io-threads {fleet.io_threads}, sized for a {fleet.host_cores}-core host): Valkey 8.x refuses "
                   f"{sizing.AVOID_COPY_DIRECTIVE}\n" if sizing.AVOID_COPY_DIRECTIVE in conf else
                   f"# io-threads {fleet.io_threads}, sized for a {fleet.host_cores}-core host\n")
        files.append(RenderedFile(f"{n}-{unit_instance}.conf", header + render_config(conf), secret=fleet.auth.enabled))
    if fleet.engine_password:
        files.append(RenderedFile("engine.password", fleet.engine_password + "\n", secret=True))
    return files


# ----------------------------------------------------------------------------- k8s


def _meta(fleet: FleetSpec, name: str) -> dict:
    meta: dict = {"name": name, "labels": {"app.kubernetes.io/name": fleet.name, "app.kubernetes.io/managed-by": "kvctl"}}
    if fleet.namespace:
        meta["namespace"] = fleet.namespace
    return meta


def k8s_objects(fleet: FleetSpec) -> list[dict]:
    """ConfigMap, (Secret), headless Service and StatefulSet with replicas = ranks × instances per rank."""
    labels = {"app.kubernetes.io/name": fleet.name}
    conf: dict[str, object] = {"port": fleet.k8s_port, "bind": "0.0.0.0", "daemonize": "no", "dir": "/data", "logfile": ""}
    no_secret_auth = spec.Auth(insecure_no_auth=fleet.auth.insecure_no_auth)
    conf.update(spec.cache_settings(fleet.maxmemory_per_instance, fleet.io_threads, no_secret_auth, version=fleet.server_version))
    if fleet.auth.enabled:
        conf["include"] = f"{K8S_AUTH_DIR}/auth.conf"  # requirepass + engine ACL user, from the Secret
    objs: list[dict] = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(fleet, f"{fleet.name}-config"), "data": {"valkey.conf": render_config(conf)}},
    ]
    if fleet.auth.enabled:
        auth_conf = render_config({"requirepass": fleet.auth.password, "user": [spec.engine_acl(fleet.engine_password or "")]})
        objs.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": _meta(fleet, f"{fleet.name}-auth"),
                "type": "Opaque",
                "stringData": {"auth.conf": auth_conf, "password": fleet.auth.password, "engine-password": fleet.engine_password},
            }
        )
    objs.append(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(fleet, fleet.service),
            "spec": {
                "clusterIP": "None",  # headless: rank r is NAME-r.SERVICE (instance i of rank r: NAME-<r*K+i>)
                "selector": dict(labels),
                "ports": [{"name": "resp", "port": fleet.k8s_port, "targetPort": "resp"}],
            },
        }
    )
    limit = memory_limit_bytes(fleet.maxmemory_per_instance)
    ping = f'[ "$(valkey-cli -p {fleet.k8s_port} ping)" = PONG ]'
    container: dict = {
        "name": "valkey",
        "image": fleet.image,
        "args": ["valkey-server", f"{K8S_CONF_DIR}/valkey.conf"],
        "ports": [{"name": "resp", "containerPort": fleet.k8s_port}],
        "resources": {
            # Valkey's io-threads counts the main thread: io_threads cores cover both
            "requests": {"cpu": str(fleet.io_threads), "memory": f"{limit // MIB}Mi"},
            "limits": {"memory": f"{limit // MIB}Mi"},
        },
        "readinessProbe": {"exec": {"command": ["sh", "-c", ping]}, "periodSeconds": 5, "timeoutSeconds": 2},
        "livenessProbe": {"tcpSocket": {"port": "resp"}, "initialDelaySeconds": 5, "periodSeconds": 10},
        "volumeMounts": [{"name": "config", "mountPath": K8S_CONF_DIR}, {"name": "data", "mountPath": "/data"}],
    }
    volumes: list[dict] = [{"name": "config", "configMap": {"name": f"{fleet.name}-config"}}, {"name": "data", "emptyDir": {}}]
    if fleet.auth.enabled:
        container["env"] = [{"name": "REDISCLI_AUTH", "valueFrom": {"secretKeyRef": {"name": f"{fleet.name}-auth", "key": "password"}}}]
        container["volumeMounts"].append({"name": "auth", "mountPath": K8S_AUTH_DIR, "readOnly": True})
        volumes.append({"name": "auth", "secret": {"secretName": f"{fleet.name}-auth", "defaultMode": 0o440}})
    objs.append(
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": _meta(fleet, fleet.name),
            "spec": {
                "serviceName": fleet.service,
                "replicas": fleet.instances,
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": dict(labels)},
                "template": {
                    "metadata": {"labels": dict(labels)},
                    "spec": {
                        "securityContext": {"runAsNonRoot": True, "runAsUser": VALKEY_UID, "runAsGroup": VALKEY_UID, "fsGroup": VALKEY_UID},
                        "containers": [container],
                        "volumes": volumes,
                    },
                },
            },
        }
    )
    return objs


def render_k8s(fleet: FleetSpec) -> list[RenderedFile]:
    """One manifest per object; the Secret (if any) is written mode 0600."""
    files = []
    for obj in k8s_objects(fleet):
        kind = obj["kind"].lower()
        layout = f"{fleet.ranks} rank(s)" if fleet.instances_per_rank == 1 else (
            f"{fleet.ranks} rank(s) × {fleet.instances_per_rank} instances, pod NAME-<r*{fleet.instances_per_rank}+i> = rank r instance i")
        header = f"# {obj['kind']} {obj['metadata']['name']}: {layout}, rendered by kvctl deploy-valkey --target k8s\n"
        files.append(RenderedFile(f"{kind}.yaml", header + yaml.dump(obj, Dumper=_Dumper, sort_keys=False), secret=obj["kind"] == "Secret"))
    return files


# ----------------------------------------------------------------------------- write / apply


def write_files(out: Path, files: list[RenderedFile]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for f in files:
        path = out / f.name
        if f.secret:
            spec.write_secret(path, f.text)
        else:
            write_atomic(path, f.text)
        written.append(path)
    return written


#: ``kubectl apply`` / ``systemctl`` of --apply: talks to an API server or init system, not to the tier, and the
#: command has no --timeout; two minutes covers a slow API server without hanging forever.
APPLY_TIMEOUT_S = 120.0


def _run(cmd: list[str]) -> None:
    if shutil.which(cmd[0]) is None:
        raise BinaryNotFound(f"--apply needs `{cmd[0]}` on PATH")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=APPLY_TIMEOUT_S)
    if proc.returncode != 0:
        last = (proc.stderr or proc.stdout).strip().splitlines()
        raise KvctlError(f"`{' '.join(cmd)}` failed: {last[-1] if last else f'exit {proc.returncode}'}")


def apply(target: str, out: Path, fleet: FleetSpec) -> str:
    """Install and start what was rendered: systemd units (root) or ``kubectl apply -f OUT``."""
    if target == "k8s":
        _run(["kubectl", "apply", "-f", str(out)])
        return f"kubectl apply -f {out}"
    n = fleet.name
    for tool in ("install", "systemctl"):
        if shutil.which(tool) is None:
            raise BinaryNotFound(f"--apply needs `{tool}` on PATH")
    _run(["install", "-m", "0644", str(out / f"{n}@.service"), f"/etc/systemd/system/{n}@.service"])
    _run(["install", "-d", "-m", "0755", f"/etc/{n}"])
    units = fleet.unit_instances()
    for _, _, u in units:
        _run(["install", "-m", "0640", "-g", "valkey", str(out / f"{n}-{u}.conf"), f"/etc/{n}/{n}-{u}.conf"])
    _run(["systemctl", "daemon-reload"])
    _run(["systemctl", "enable", "--now"] + [f"{n}@{u}" for _, _, u in units])
    return f"enabled {n}@{units[0][2]}..{units[-1][2]}"
