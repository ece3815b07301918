"""Plugin hooks (pluggy). Built-in commands register exactly like third-party ones.

Third-party plugins expose an entry point in the ``kvctl`` group; those are
not loaded under pytest (``KVCTL_TESTING``) so tests never depend on what is
installed on the developer's machine.
"""

from __future__ import annotations

import importlib
import os

import pluggy

hookspec = pluggy.HookspecMarker("kvctl")
hookimpl = pluggy.HookimplMarker("kvctl")

#: Modules that implement the built-in commands, registered in this order.
DEFAULT_PLUGINS = (
    "kvctl.commands.cost",
    "kvctl.commands.deploy",
    "kvctl.commands.bench",
    "kvctl.commands.diagnose",
    "kvctl.commands.loading",
    "kvctl.commands.replay",
    "kvctl.commands.report",
    "kvctl.commands.simulate",
    "kvctl.commands.plan",
    "kvctl.commands.exporter",
    "kvctl.commands.doctor",
    "kvctl.commands.drill",
    "kvctl.commands.explain",
    "kvctl.commands.runbook",
)


class Specs:
    @hookspec
    def register_commands(self, cli):
        """Add click commands or groups to the root ``kvctl`` group."""

    @hookspec
    def register_deploy_targets(self, register):
        """Call ``register(name, renderer)`` per deploy target; ``renderer(FleetSpec) -> list[RenderedFile]`` (kvctl.tier.render_targets).

        Each name becomes a ``--target`` choice of ``deploy-valkey up``, ``lmcache-config`` and
        ``vllm-config`` (files rendered to ``--out``; ``--apply`` installs only systemd and k8s).
        The built-ins register first, so a plugin cannot replace ``local``, ``systemd`` or ``k8s``.
        """


def plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("kvctl")
    pm.add_hookspecs(Specs)
    for name in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(name), name)
    if not os.environ.get("KVCTL_TESTING"):
        pm.load_setuptools_entrypoints("kvctl")
    return pm
