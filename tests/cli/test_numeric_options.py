"""Every numeric option of `cost`, `bench` and `deploy-valkey` refuses NaN, inf, negative and absurd values (exit 2),
and `cost --json` never prints NaN or Infinity for any value the options accept (issue 13, "The CLI surface").

The options are discovered from the click tree, so an option added later is covered (or this test names it).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvctl.cli import cli
from kvctl.commands.options import ByteSize

MODEL = str(Path(__file__).resolve().parents[2] / "configs" / "models" / "deepseek-v3.json")
TIER_DIR = "/nonexistent/kvctl-numeric-options-test"  # never created: every bad value fails while parsing

#: A valid invocation of each command; one numeric option at a time gets a bad value on top of it.
BASE = {
    ("cost", "breakeven"): ["--bytes-per-token", "48437.5", "--prefill-rate", "52200"],
    ("cost", "fit-t0"): ["--latency-s", "0.4", "--prompt-gb", "0.79", "--tier-gbps", "10.76"],
    ("cost", "predict"): ["--bytes-per-token", "48437.5", "--prefill-rate", "52200", "--t0", "0.33", "--tier-gbps", "10", "--prompt-tokens", "4096"],
    ("cost", "rho"): ["--arrival-rate", "1.21", "--prompt-gb", "0.79", "--instance-gbps", "0.85"],
    ("cost", "kv-size"): ["--config", MODEL],
    ("cost", "report"): [],
    ("bench",): ["--valkey", "resp://127.0.0.1:1"],
    ("deploy-valkey", "up"): ["--ranks", "1", "--dir", TIER_DIR],
    ("deploy-valkey", "status"): ["--dir", TIER_DIR],
    ("deploy-valkey", "down"): ["--dir", TIER_DIR],
    ("deploy-valkey", "lmcache-config"): ["--target", "k8s", "--ranks", "2"],
    ("deploy-valkey", "vllm-config"): ["--target", "k8s", "--ranks", "2"],
    # replay/report/simulate: every bad value fails while parsing, before a file is read or a request sent
    ("replay",): ["/nonexistent/kvctl-trace.jsonl", "--engine-url", "http://127.0.0.1:1", "--dry-run"],
    ("report",): ["/nonexistent/kvctl-run.jsonl"],
    ("simulate",): ["--arrival-rate", "1", "--prompt-tokens", "100", "--prefill-rate", "1000", "--bytes-per-token", "1000", "--instance-gbps", "1"],
}
SKIP: set = set()


def _commands(group: click.Group, path: tuple[str, ...] = ()):
    for name, cmd in group.commands.items():
        p = (*path, name)
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, p)
        else:
            yield p, cmd


def _numeric(cmd: click.Command) -> list[click.Option]:
    return [
        p for p in cmd.params
        if isinstance(p, click.Option) and not p.count and not p.is_flag
        and isinstance(p.type, (click.types.IntParamType, click.types.FloatParamType, ByteSize))
    ]  # fmt: skip


COVERED = [(path, cmd) for path, cmd in _commands(cli) if path[0] in ("cost", "bench", "deploy-valkey", "replay", "report", "simulate") and path not in SKIP]
OPTIONS = [(path, opt) for path, cmd in COVERED for opt in _numeric(cmd)]


def test_every_command_has_a_base_invocation():
    assert sorted(p for p, _ in COVERED) == sorted(BASE)
    assert len(OPTIONS) >= 40  # cost 30, bench 14, deploy-valkey 11 when this was written


def test_every_numeric_option_has_an_upper_bound():
    unbounded = [f"{' '.join(p)} {o.opts[0]}" for p, o in OPTIONS if not isinstance(o.type, ByteSize) and getattr(o.type, "max", None) is None]
    assert not unbounded, unbounded


def _bad_value(option: click.Option) -> st.SearchStrategy[str]:
    special = st.sampled_from(["nan", "NaN", "-nan", "inf", "-inf", "Infinity", "1e999", "-1e999"])
    negative = st.one_of(st.integers(max_value=-1).map(str), st.floats(max_value=-1e-9, allow_infinity=False).map(repr))
    if isinstance(option.type, ByteSize):
        huge = st.integers(min_value=option.type.max_bytes + 1, max_value=10**30).map(str)
        return st.one_of(special, negative, huge, st.sampled_from(["-1mb", "nanmb", "1e99mb", "999999999tb", "1e"]))  # 1e3mb is 1000 MiB
    huge = st.one_of(st.integers(min_value=10**13, max_value=10**40).map(str), st.floats(min_value=1e13, allow_infinity=False).map(repr))
    return st.one_of(special, negative, huge)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_nan_inf_negative_and_huge_values_exit_2_naming_the_option(data):
    path, option = data.draw(st.sampled_from(OPTIONS), label="option")
    value = data.draw(_bad_value(option), label="value")
    flag = option.opts[0]
    result = CliRunner().invoke(cli, [*path, *BASE[path], flag, value, "--json"])
    assert result.exit_code == 2, (path, flag, value, result.output)
    assert f"'{flag}'" in result.output, result.output


def _good_value(option: click.Option) -> st.SearchStrategy[str]:
    t = option.type
    if isinstance(t, click.types.IntParamType):
        return st.integers(min_value=t.min if t.min is not None else 0, max_value=t.max).map(str)
    return st.floats(
        min_value=t.min if t.min is not None else 0.0, max_value=t.max,
        exclude_min=bool(t.min_open), exclude_max=bool(t.max_open), allow_nan=False, allow_infinity=False,
    ).map(repr)  # fmt: skip


COST = [(path, cmd) for path, cmd in COVERED if path[0] == "cost"]


def _strict(text: str) -> object:
    def refuse(name: str) -> None:
        raise AssertionError(f"JSON holds {name}")

    return json.loads(text, parse_constant=refuse)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_cost_json_is_finite_for_every_accepted_value(data):
    path, cmd = data.draw(st.sampled_from(COST), label="command")
    args = list(BASE[path])
    for opt in _numeric(cmd):
        if data.draw(st.booleans(), label=f"set {opt.opts[0]}"):
            args += [opt.opts[0], data.draw(_good_value(opt), label=opt.opts[0])]
    result = CliRunner().invoke(cli, [*path, *args, "--json"])
    assert result.exit_code in (0, 2), (path, args, result.output)  # 2: a combination the model refuses, with a message
    if result.exit_code == 0:
        _finite_json(result.stdout)
    else:
        assert "Error:" in result.output and "Traceback" not in result.output


def _finite_json(text: str) -> None:
    numbers: list[float] = []

    def walk(x):
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
        elif isinstance(x, float):
            numbers.append(x)

    walk(_strict(text))
    assert all(math.isfinite(x) for x in numbers)


@pytest.mark.parametrize("path", [p for p, _ in COST], ids=" ".join)
def test_cost_options_at_their_bounds_are_accepted_and_finite(path):
    """The property above lets a value be refused (exit 2): alone, a model that refused everything would pass
    it. Here every numeric option of each cost command, at its lowest and highest accepted value, on top of
    the base invocation, is checked: most are accepted, and every accepted one prints finite JSON."""
    cmd = dict(COST)[path]
    ran = accepted = 0
    for opt in _numeric(cmd):
        t = opt.type
        lo = t.min if t.min is not None else 0
        values = [lo if not t.min_open else (lo + 1 if isinstance(t, click.types.IntParamType) else lo * 2 + 1e-3),
                  t.max if not getattr(t, "max_open", False) else t.max * 0.999]
        for v in values:
            result = CliRunner().invoke(cli, [*path, *BASE[path], opt.opts[0], repr(v) if isinstance(v, float) else str(v), "--json"])
            ran += 1
            if result.exit_code == 0:
                accepted += 1
                _finite_json(result.stdout)
            else:
                assert result.exit_code == 2 and "Error:" in result.output, (path, opt.opts[0], v, result.output)
    assert ran == 0 or accepted * 2 >= ran, f"{' '.join(path)}: only {accepted} of {ran} boundary values accepted"
    result = CliRunner().invoke(cli, [*path, *BASE[path], "--json"])
    assert result.exit_code == 0, result.output  # the base invocation itself is accepted
    _finite_json(result.stdout)


@pytest.mark.parametrize(
    "args, flag",
    [
        (["cost", "fit-t0", "--latency-s", "nan", "--prompt-gb", "0.79", "--tier-gbps", "10.76"], "--latency-s"),
        (["cost", "breakeven", "--bytes-per-token", "1e308", "--prefill-rate", "52200"], "--bytes-per-token"),
        (["bench", "--valkey", "resp://127.0.0.1:1", "--chunk-bytes", "nan"], "--chunk-bytes"),
        (["deploy-valkey", "up", "--ranks", "1", "--io-threads", "1000"], "--io-threads"),
    ],
)
def test_the_issue_examples(args, flag):
    """The invocations issue 13 quotes: NaN in t0_s, Infinity in B*, a ValueError, Valkey refusing io-threads."""
    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == 2 and f"'{flag}'" in result.output, result.output
