"""One value per fact (kvctl.core.thresholds): nothing else in kvctl compares ρ, a GPU utilisation or a
chunk size default with a number of its own.

Read from the sources with ``ast`` (not regexes): a comparison such as ``rho >= 0.7`` or
``max(utils) < 5``, a ``chunk_tokens: int = 256`` default or ``default=256`` on a --chunk-* option
anywhere but kvctl/core/thresholds.py fails, naming the file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvctl.core import thresholds

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for d in ("kvctl", "connector", "plugins") for p in (ROOT / d).rglob("*.py") if p.name != "thresholds.py")
WATCHED = ("rho", "util", "idle")  # identifiers holding a ρ or a GPU utilisation


def _idents(node: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id.lower())
        elif isinstance(n, ast.Attribute):
            out.add(n.attr.lower())
    return out


def _number(node: ast.AST) -> float | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value)
    return None


def threshold_literals(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of every comparison of a watched quantity with a nonzero literal, and every literal chunk default."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            nums = [x for x in sides if _number(x) not in (None, 0.0)]
            others = set().union(*(_idents(x) for x in sides if _number(x) is None))
            if nums and any(w in i for i in others for w in WATCHED):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.arguments):
            named = node.posonlyargs + node.args
            pairs = list(zip(named[len(named) - len(node.defaults):], node.defaults)) + list(zip(node.kwonlyargs, node.kw_defaults))
            found += [
                (a.lineno, f"{a.arg}={ast.unparse(d)}") for a, d in pairs if d is not None
                and (("chunk" in a.arg and _number(d) == thresholds.CHUNK_TOKENS) or (any(w in a.arg for w in WATCHED) and _number(d) not in (None, 0.0)))
            ]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            name, value = node.target.id.lower(), _number(node.value)
            if ("chunk" in name and value == thresholds.CHUNK_TOKENS) or (any(w in name for w in WATCHED) and value not in (None, 0.0)):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and any(isinstance(a, ast.Constant) and isinstance(a.value, str) and "--chunk" in a.value for a in node.args):
            found += [(node.lineno, f"{node.args[0].value} default={k.value.value}") for k in node.keywords if k.arg == "default" and _number(k.value) == thresholds.CHUNK_TOKENS]
    return found


def test_the_check_finds_what_it_is_for():
    """The scan must be able to fail: each kind of restated threshold is caught, the constants' use is not."""
    bad = """
def f(rho, utils, d, chunk_tokens: int = 256):
    if rho >= 0.7 or 1 <= d.rho or max(utils) < 5 or d['x'].gpu_utilization_pct < 30.0:
        pass
class C:
    chunk_size: int = 256
    warn_rho: float = 0.7
opt = click.option("--chunk-size", type=int, default=256)
"""
    good = """
def f(rho, n_inst, chunk_tokens: int = CHUNK_TOKENS, timeout_s: float = 256):
    if rho >= RHO_HIGH or rho is None or rho > 0 or n_inst > 1 or max(utils) < GPU_IDLE_PCT:
        pass
"""
    assert sorted(line for line, _ in threshold_literals(ast.parse(bad))) == [2, 3, 3, 3, 3, 6, 7, 8]
    assert threshold_literals(ast.parse(good)) == []


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_restates_a_threshold(path):
    found = threshold_literals(ast.parse(path.read_text(), str(path)))
    assert not found, f"{path.relative_to(ROOT)}: use kvctl.core.thresholds instead of " + "; ".join(f"line {n}: {w}" for n, w in found)


# --- timeouts: the command's --timeout, or a named constant that says why not --------------------------------

TIMEOUT_SCOPE = ("kvctl/diagnose", "kvctl/ops/doctor.py", "kvctl/ops/doctor_host.py", "kvctl/ops/exporter.py", "kvctl/ops/exporter_http.py",
                 "kvctl/tier", "kvctl/bench")
TIMEOUT_SOURCES = sorted(p for s in TIMEOUT_SCOPE for p in ([ROOT / s] if s.endswith(".py") else (ROOT / s).rglob("*.py")))
CLIENT_FACTORIES = {"Admin": 1}  # the argument (by position) that is its deadline


def timeout_literals(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, call) of every call given a number for a timeout: ``timeout=10``, ``timeout_s=max(t, 10.0)``, ``Admin(url, 3.0)``."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        values = [k.value for k in node.keywords if k.arg and "timeout" in k.arg]
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if name in CLIENT_FACTORIES and len(node.args) > CLIENT_FACTORIES[name]:
            values.append(node.args[CLIENT_FACTORIES[name]])
        if any(_number(n) not in (None, 0.0) for v in values for n in ast.walk(v)):
            found.append((node.lineno, ast.unparse(node)[:120]))
    return found


def test_the_timeout_check_finds_literals():
    bad = "f(timeout=10)\ng(x, timeout_s=max(t, 10.0))\nAdmin(url, 3.0, pw)\nr.join(timeout=t + 5)\n"
    good = "f(timeout=timeout_s)\ng(timeout_s=max(t, FLOOR_S))\nAdmin(url, timeout_s)\nq.get(timeout=POLL_S)\n"
    assert sorted(n for n, _ in timeout_literals(ast.parse(bad))) == [1, 2, 3, 4]
    assert timeout_literals(ast.parse(good)) == []


@pytest.mark.parametrize("path", TIMEOUT_SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_read_ignores_the_timeout(path):
    """Each timeout follows the command's --timeout, or is a named constant whose comment says why it is not a per-source read."""
    found = timeout_literals(ast.parse(path.read_text(), str(path)))
    assert not found, f"{path.relative_to(ROOT)}: " + "; ".join(f"line {n}: {w}" for n, w in found)


# --- click defaults: an option whose default is a shared fact reads its constant (issue 22) -------------------

#: option -> the kvctl.core.thresholds constant its default is, wherever a command takes it
SHARED_DEFAULTS = {
    "--t0": "PAPER_T0_S", "--rho-target": "RHO_TARGET", "--base-port": "BASE_PORT",
    "--window": "DIAGNOSIS_WINDOW_S", "--async-timeout": "ASYNC_TIMEOUT_S",
}
#: options whose equal literal defaults in several commands are different facts, and why
UNRELATED_DEFAULTS = {"--timeout": "bench's per-call deadline and diagnose's per-source read: both 5 s, not one setting"}
CLI_SOURCES = sorted((ROOT / "kvctl" / "commands").rglob("*.py"))


def option_defaults(tree: ast.AST) -> list[tuple[int, str, ast.expr]]:
    """(line, first flag, default expression) of every ``click.option("--x", ..., default=...)``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "option":
            flags = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("--")]
            for k in node.keywords:
                if k.arg == "default" and flags:
                    out.append((node.lineno, flags[0].split("/")[0], k.value))
    return out


def _literal(expr: ast.expr) -> float | None:
    value = _number(expr)
    return value if value not in (None, 0.0, 1.0) else None  # 0 and 1 are no facts


def test_the_default_check_finds_literals():
    src = 'click.option("--t0", default=0.33)\nclick.option("--t0", default=thresholds.PAPER_T0_S)\nclick.option("--seed", default=0)\n'
    found = [(n, f) for n, f, d in option_defaults(ast.parse(src)) if _literal(d) is not None]
    assert found == [(1, "--t0")]


def test_shared_option_defaults_read_their_constant():
    literal = [f"{p.relative_to(ROOT)}:{n} {flag}" for p in CLI_SOURCES for n, flag, d in option_defaults(ast.parse(p.read_text()))
               if flag in SHARED_DEFAULTS and _literal(d) is not None]
    assert not literal, f"default= restates a kvctl.core.thresholds constant: {literal}"
    from tests.cli_helpers import _commands

    from kvctl.cli import cli

    seen = set()
    for name, cmd in _commands(cli):
        for param in cmd.params:
            const = next((SHARED_DEFAULTS[o] for o in param.opts if o in SHARED_DEFAULTS), None)
            if const and isinstance(param.default, (int, float)):  # no default: None or click's UNSET
                assert param.default == getattr(thresholds, const), f"{name} {param.opts[0]}: {param.default} != {const}"
                seen.add(const)
    assert seen == set(SHARED_DEFAULTS.values())  # every shared default is in use, so the check checks something


def test_no_literal_default_is_repeated_across_commands():
    """The same option with the same literal default in two places is one fact written twice: a constant."""
    where: dict[tuple[str, float], list[str]] = {}
    for p in CLI_SOURCES:
        for n, flag, d in option_defaults(ast.parse(p.read_text())):
            if _literal(d) is not None and flag not in UNRELATED_DEFAULTS:
                where.setdefault((flag, _literal(d)), []).append(f"{p.relative_to(ROOT)}:{n}")
    repeated = {k: v for k, v in where.items() if len(v) > 1}
    assert not repeated, f"put these in kvctl/core/thresholds.py: {repeated}"


# --- the tier's directory and memory, the 5 s and 3 s read timeouts: one home each (issue 32 item 5) ------------------

#: the constant, the literal it must not be written as, and the --timeout of the commands that default to it
ONE_HOME = {
    "TIER_DIR": ("./kv-tier", ()), "TIER_MAXMEMORY": ("400mb", ()),
    "READ_TIMEOUT_S": (5.0, ("kvctl diagnose", "kvctl diagnose run", "kvctl diagnose capture", "kvctl doctor")),  # one default (issue 48)
    "CHECK_TIMEOUT_S": (3.0, ()), "BENCH_TIMEOUT_S": (5.0, ("kvctl bench",)),
}


def home_literals(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of every whole string "./kv-tier" or "400mb", and every 5.0 or 3.0 default of a timeout: a
    parameter's, a field's or a click option's."""
    found = [(n.lineno, repr(n.value)) for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in ("./kv-tier", "400mb")]
    for node in ast.walk(tree):
        if isinstance(node, ast.arguments):
            named = node.posonlyargs + node.args
            pairs = list(zip(named[len(named) - len(node.defaults):], node.defaults)) + list(zip(node.kwonlyargs, node.kw_defaults))
            found += [(a.lineno, f"{a.arg}={ast.unparse(d)}") for a, d in pairs if d is not None and "timeout" in a.arg and _number(d) in (3.0, 5.0)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and "timeout" in node.target.id.lower() \
                and node.value is not None and _number(node.value) in (3.0, 5.0):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and any(isinstance(a, ast.Constant) and a.value == "--timeout" for a in node.args):
            found += [(node.lineno, f"--timeout default={ast.unparse(k.value)}") for k in node.keywords if k.arg == "default" and _number(k.value) in (3.0, 5.0)]
    return found


def test_the_home_check_finds_literals():
    bad = ('d = "./kv-tier"\nclick.option("--maxmemory", default="400mb")\ndef f(timeout_s: float = 5.0): pass\n'
           'class C:\n    timeout_s: float = 3.0\nclick.option("--timeout", "t", default=5.0)\n')
    good = '"""tiers live in ./kv-tier, 400mb by default"""\ndef f(timeout_s: float = READ_TIMEOUT_S, stop_s: float = 5.0): pass\n'
    assert sorted(n for n, _ in home_literals(ast.parse(bad))) == [1, 2, 3, 5, 6]
    assert home_literals(ast.parse(good)) == []


@pytest.mark.parametrize("path", [p for p in SOURCES if p.is_relative_to(ROOT / "kvctl")], ids=lambda p: str(p.relative_to(ROOT)))
def test_the_tier_defaults_and_read_timeouts_have_one_home(path):
    found = home_literals(ast.parse(path.read_text(), str(path)))
    assert not found, f"{path.relative_to(ROOT)}: use kvctl.core.thresholds ({', '.join(ONE_HOME)}): " + "; ".join(f"line {n}: {w}" for n, w in found)


def test_the_commands_default_to_the_homes():
    from tests.cli_helpers import _commands

    from kvctl.cli import cli

    commands = dict(_commands(cli))
    for const, (value, names) in ONE_HOME.items():
        assert getattr(thresholds, const) == value
        for name in names:
            (param,) = [p for p in commands[name].params if "--timeout" in getattr(p, "opts", ())]
            assert param.default == getattr(thresholds, const), (name, const)
