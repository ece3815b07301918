"""``kvctl cost``: the paper's cost model from the command line (§4)."""

from __future__ import annotations

from typing import Any

import click

from kvctl import cost, render, thresholds
from kvctl.commands.options import (
    ARRIVAL_RATE, BANDWIDTH_GBPS, BYTES_PER_TOKEN, BYTES_PER_TOKEN_HELP, CHUNK_TOKENS, LATENCY_S, PREFILL_RATE, PROMPT_GB, T0_S, TOKENS, TP,
    TP_HELP, FiniteFloat, RenamedOption, bytes_per_token_options, output_options,
)
from kvctl.errors import InvalidInput
from kvctl.hooks import hookimpl
from kvctl.kvsize import DTYPE_BYTES, kv_size_from_file


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(cost_group)


def _tokens(first: tuple[int, ...], rest: tuple[int, ...]) -> list[int]:
    """``--prompt-tokens 4096 16384`` parses as one option value plus extra positionals; join them."""
    return list(first) + list(rest)


@click.group("cost")
def cost_group() -> None:
    """The cost model of loading KV from the remote tier vs recomputing it.

    \b
    recompute   T = n / R                (n tokens, R prefill tokens/s)
    load        T = T0 + n·s / B         (s bytes/token, B GB/s, T0 fixed per hit)
    break-even  B* = s·R;  no bandwidth helps below n* = R·T0 tokens
    queue       ρ = λ·n·s / B            (synchronous loading; unstable at ρ ≥ 1)
    GB = 1e9 bytes, MB = 1e6 bytes.
    """


@cost_group.command("breakeven")
@bytes_per_token_options(pass_tp=True)
@click.option("--prefill-rate", type=PREFILL_RATE, required=True, help="Prefill throughput R in tokens/s.")
@click.option("--t0", type=T0_S, help="Fixed per-hit cost T0 in seconds; adds n* = R·T0.")
@output_options
def breakeven_cmd(bytes_per_token: float, tp: int, prefill_rate: float, t0: float | None, as_json: bool) -> None:
    """Break-even bandwidth B* = s·R of the whole tier, and n* = R·T0 when --t0 is given.

    With --tp N, also each rank's share: s/N bytes per token, and B*/N, what each
    of N instances (one per rank) must deliver.
    """
    res = cost.summarize_breakeven(bytes_per_token, prefill_rate, t0, tp)
    if as_json:
        data = render.to_jsonable(res)
        if t0 is None:
            data.pop("t0_s")
            data.pop("min_hit_tokens")
        render.emit_json(data)
        return
    pairs = [
        ("bytes per token (s, whole model)", res.bytes_per_token),
        ("prefill rate (R, tok/s)", res.prefill_rate_tok_s),
        ("break-even bandwidth B* = s·R (GB/s, whole tier)", res.breakeven_gbps),
    ]
    if res.tp > 1:
        pairs += [
            (f"bytes per token per rank (s/{res.tp})", res.bytes_per_token_per_rank),
            (f"B* per instance, one per rank (B*/{res.tp}, GB/s)", res.breakeven_gbps_per_rank),
        ]
    if res.min_hit_tokens is not None:
        pairs += [("fixed cost T0 (s)", res.t0_s), ("min hit tokens n* = R·T0", round(res.min_hit_tokens))]
    render.key_values("Break-even", pairs, caption="A tier slower than B* makes every hit slower than recompute.")


@cost_group.command("fit-t0")
@click.option("--latency-s", type=LATENCY_S, required=True, help="Measured time of one hit, seconds.")
@click.option("--prompt-gb", type=PROMPT_GB, help="KV bytes of that prompt in GB (or --prompt-tokens with --bytes-per-token).")
@click.option("--prompt-tokens", type=TOKENS, cls=RenamedOption, old=["--tokens"], help="Prompt length in tokens (with --bytes-per-token).")
@bytes_per_token_options(required=False)
@click.option("--tier-gbps", type=BANDWIDTH_GBPS, required=True, cls=RenamedOption, old=["--bandwidth-gbps"],
              help="Bandwidth B of the whole tier (all instances together) during the measurement, GB/s.")
@output_options
def fit_t0_cmd(latency_s: float, prompt_gb: float | None, prompt_tokens: int | None, bytes_per_token: float | None, tier_gbps: float, as_json: bool) -> None:
    """Fit the fixed per-hit cost: T0 = t_measured − n·s / B."""
    prompt_bytes = _prompt_bytes(prompt_gb, prompt_tokens, bytes_per_token)
    t0 = cost.fit_t0(latency_s, prompt_bytes, tier_gbps)
    if t0 < 0:
        raise InvalidInput(f"the measured latency {latency_s}s is below the pure transfer time; check --tier-gbps")
    if as_json:
        render.emit_json({"t0_s": t0, "latency_s": latency_s, "prompt_gb": prompt_bytes / cost.GB, "bandwidth_gbps": tier_gbps})
        return
    render.key_values("Fitted fixed cost", [("transfer n·s/B (s)", prompt_bytes / (tier_gbps * cost.GB)), ("T0 (s)", t0)])


def _prompt_bytes(prompt_gb: float | None, tokens: int | None, bytes_per_token: float | None) -> float:
    if prompt_gb is not None:
        return prompt_gb * cost.GB
    if tokens is not None and bytes_per_token is not None:
        return tokens * bytes_per_token
    raise click.UsageError("give --prompt-gb, or --prompt-tokens with --bytes-per-token / --model-config")


@cost_group.command("predict")
@bytes_per_token_options(pass_tp=True)
@click.option("--prefill-rate", type=PREFILL_RATE, required=True, help="Prefill throughput R in tokens/s.")
@click.option("--t0", type=T0_S, default=thresholds.PAPER_T0_S, show_default=True, help="Fixed per-hit cost T0 in seconds (the paper's by default; fit yours with `kvctl cost fit-t0`).")
@click.option("--tier-gbps", type=BANDWIDTH_GBPS, required=True, cls=RenamedOption, old=["--bandwidth-gbps"],
              help="Bandwidth B of the whole tier in GB/s (all instances together).")
@click.option("--prompt-tokens", "tokens_opt", type=TOKENS, multiple=True, required=True, cls=RenamedOption, old=["--tokens"],
              help="Prompt lengths: --prompt-tokens 4096 16384 65536.")
@click.argument("more_tokens", nargs=-1, type=TOKENS, metavar="")
@output_options
def predict_cmd(bytes_per_token: float, tp: int, prefill_rate: float, t0: float, tier_gbps: float, tokens_opt: tuple[int, ...], more_tokens: tuple[int, ...], as_json: bool) -> None:
    """Per-length verdict: load from the tier, or recompute?"""
    preds = cost.predict(_tokens(tokens_opt, more_tokens), bytes_per_token, prefill_rate, tier_gbps, t0)
    if as_json:
        render.emit_json({"bytes_per_token": bytes_per_token, "bytes_per_token_per_rank": bytes_per_token / tp, "tp": tp,
                          "prefill_rate_tok_s": prefill_rate, "t0_s": t0, "bandwidth_gbps": tier_gbps, "predictions": preds})
        return
    render.table(
        f"Load vs recompute at {tier_gbps:g} GB/s",
        ["tokens", "recompute s", "load s", "speedup", "verdict"],
        [(p.tokens, p.recompute_s, p.load_s, f"{p.speedup:.2f}×", p.verdict) for p in preds],
    )


@cost_group.command("rho")
@click.option("--arrival-rate", type=ARRIVAL_RATE, required=True, help="Hit arrival rate λ in requests/s.")
@click.option("--prompt-gb", type=PROMPT_GB, help="KV bytes loaded per request in GB (or --prompt-tokens with --bytes-per-token).")
@click.option("--prompt-tokens", type=TOKENS, cls=RenamedOption, old=["--tokens"], help="Hit tokens per request (with --bytes-per-token).")
@bytes_per_token_options(required=False, pass_tp=True)
@click.option("--instance-gbps", type=BANDWIDTH_GBPS, required=True, cls=RenamedOption, old=["--bandwidth-gbps"], help="Bandwidth of ONE instance, GB/s.")
@click.option("--rho-target", type=FiniteFloat(min=0.01, max=1, max_open=True), default=thresholds.RHO_TARGET, show_default=True,
              cls=RenamedOption, old=["--target-rho"], help="Utilisation to size the tier for.")
@output_options
def rho_cmd(arrival_rate: float, prompt_gb: float | None, prompt_tokens: int | None, bytes_per_token: float | None, tp: int, instance_gbps: float, rho_target: float, as_json: bool) -> None:
    """Utilisation of synchronous loading, ρ = λ·n·s / B, and instances for the target ρ.

    ρ is for one instance serving the whole request (s the whole model's bytes per
    token). With --tp N also ρ of N such instances, one per rank, each moving s/N.
    """
    res = cost.summarize_rho(arrival_rate, _prompt_bytes(prompt_gb, prompt_tokens, bytes_per_token), instance_gbps, rho_target, tp)
    if as_json:
        data = render.to_jsonable(res)
        if bytes_per_token is not None and prompt_gb is None:
            data.update(bytes_per_token=bytes_per_token, bytes_per_token_per_rank=bytes_per_token / tp)
        if tp == 1:
            data.pop("rho_one_instance_per_rank")
        render.emit_json(data)
        return
    render.key_values(
        "Synchronous-load queue",
        [
            ("arrival rate λ (req/s)", res.arrival_rate_per_s),
            ("KV per request (GB)", res.prompt_gb),
            ("bandwidth B of one instance (GB/s)", res.instance_gbps),
            ("ρ = λ·n·s/B (one instance)", res.rho),
            ("stable (ρ < 1)", res.stable),
            (f"instances for ρ ≤ {res.rho_target:g}", res.instances_for_rho_target),
        ]
        + ([(f"ρ with {res.tp} instances, one per rank (each s/{res.tp})", res.rho_one_instance_per_rank)] if res.tp > 1 else []),
        caption=None if res.stable else "ρ ≥ 1: the queue grows without bound — add instances or switch to async loading.",
    )


@cost_group.command("kv-size")
@click.option("--model-config", "config_path", type=click.Path(dir_okay=False), required=True, cls=RenamedOption, old=["--config"], help="Hugging Face config.json.")
@click.option("--dtype", type=click.Choice(sorted(DTYPE_BYTES)), help="KV dtype (default: what vLLM's --dtype auto serves the config's torch_dtype at: float32 -> bf16; the output says which).")
@click.option("--chunk-tokens", type=CHUNK_TOKENS, default=thresholds.CHUNK_TOKENS, show_default=True, help="Tokens per LMCache chunk.")
@click.option("--tp", type=TP, default=1, show_default=True, help="Tensor-parallel ranks: adds each rank's share (GQA/MHA heads split, replicated past the KV heads: s then counts each copy, kv_head_copies; MLA: a rank loads every tp-th chunk).")
@output_options
def kv_size_cmd(config_path: str, dtype: str | None, chunk_tokens: int, tp: int, as_json: bool) -> None:
    """KV bytes per token (whole model, and per rank with --tp) and per chunk from a model's config.json (--model-config).

    \b
    bytes_per_token           s: one token's KV over all ranks, what B* = s·R and
                              ρ compare with the whole tier's bandwidth
    bytes_per_token_per_rank  s/tp: one rank's share, to compare with ONE
                              instance's bandwidth (one instance per rank)
    chunk_bytes               one stored chunk value (a rank's heads; MLA: the latent;
                              MLA with a sparse-attention indexer: the latent rows and
                              the indexer's keys, two values in the tier)
    """
    res = kv_size_from_file(config_path, dtype=dtype, chunk_tokens=chunk_tokens, tp=tp)
    if as_json:
        render.emit_json(res)
        return
    render.key_values(
        f"KV size of {res.model}",
        [
            ("attention", res.attention),
            ("layers", res.layers),
            ("elements per token per layer", res.elements_per_token_per_layer),
            ("dtype", f"{res.dtype} ({res.dtype_source})"),
            ("tp ranks", res.tp if res.kv_head_copies == 1 else f"{res.tp} (each KV head on {res.kv_head_copies} ranks; s counts every copy)"),
            ("bytes per token (s, whole model)", res.bytes_per_token),
        ]
        + ([(f"  latent rows ({res.layers} layers x {res.latent_row_bytes} B)", res.bytes_per_token - res.indexer_bytes_per_token),
            (f"  indexer keys ({res.indexer_layers} layers x {res.indexer_row_bytes} B)", res.indexer_bytes_per_token)]
           if res.indexer_layers else [])
        + ([(f"bytes per token per rank (s/{res.tp})", res.bytes_per_token_per_rank)] if res.tp > 1 else [])
        + [
            (f"chunk bytes ({res.chunk_tokens} tokens, {'two stored values' if res.indexer_layers else 'one stored value'}, MB)",
             res.chunk_bytes / cost.MB),
        ],
        caption="B* = s·R against the whole tier's bandwidth; s/tp·R against one instance's (one per rank).",
    )


@cost_group.command("report")
@click.option("--model-config", type=click.Path(dir_okay=False), help="config.json of the model (default: the paper's GLM-5.3 FP8 setup).")
@click.option("--bytes-per-token", type=BYTES_PER_TOKEN, help=BYTES_PER_TOKEN_HELP + " Instead of --model-config.")
@click.option("--dtype", type=click.Choice(sorted(DTYPE_BYTES)), help="KV dtype with --model-config.")
@click.option("--tp", type=TP, default=1, show_default=True, help=TP_HELP)
@click.option("--label", "name", cls=RenamedOption, old=["--name"], help="Label for this model/GPU pairing (the table's title).")
@click.option("--prefill-rate", type=PREFILL_RATE, help="Prefill tokens/s on this GPU (required with a model).")
@click.option("--t0", type=T0_S, default=thresholds.PAPER_T0_S, show_default=True, help="Fixed per-hit cost T0 in seconds (the paper's by default).")
@click.option("--tier-gbps", "bandwidths", type=BANDWIDTH_GBPS, multiple=True, cls=RenamedOption, old=["--bandwidth-gbps"],
              help="Whole-tier bandwidths to compare (repeatable; default 0.85, 1.71, 10.76).")
@click.option("--prompt-tokens", "tokens", type=TOKENS, multiple=True, cls=RenamedOption, old=["--tokens"], help="Prompt lengths: --prompt-tokens 4096 16384 (or repeated).")
@click.argument("more_tokens", nargs=-1, type=TOKENS, metavar="")
@output_options
def report_cmd(model_config: str | None, bytes_per_token: float | None, dtype: str | None, tp: int, name: str | None, prefill_rate: float | None, t0: float, bandwidths: tuple[float, ...], tokens: tuple[int, ...], more_tokens: tuple[int, ...], as_json: bool) -> None:
    """One table per model/GPU pairing: B*, n*, and load vs recompute over prompt lengths.

    With no model, reproduces the paper's GLM-5.3 FP8 / B300 setup.
    """
    paper = cost.PAPER_PAIRING
    if model_config or bytes_per_token:
        if prefill_rate is None:
            raise click.UsageError("--prefill-rate is required with --model-config or --bytes-per-token")
        if model_config and bytes_per_token is None:
            size = kv_size_from_file(model_config, dtype=dtype, tp=tp)
            bytes_per_token = size.bytes_per_token
            name = name or f"{size.model} ({size.attention}, {size.dtype}, tp={tp})"
        name = name or f"{bytes_per_token:g} B/token"
    else:
        bytes_per_token = paper["bytes_per_token"]
        prefill_rate = prefill_rate or paper["prefill_rate"]
        name = name or paper["name"]
    rep = cost.summarize_pairing(
        name,
        bytes_per_token,
        prefill_rate,
        t0,
        bandwidths or paper["bandwidths_gbps"],
        _tokens(tokens, more_tokens) or cost.DEFAULT_REPORT_TOKENS,
        tp,
    )
    if as_json:
        render.emit_json({"pairings": [rep]})
        return
    render_pairing(rep)


def render_pairing(rep: cost.PairingReport) -> None:
    """The report table: rows are prompt lengths, one load column per bandwidth."""
    cols = ["tokens", "recompute s"]
    for bv in rep.bandwidths:
        cols.append(f"load s @ {bv.bandwidth_gbps:g} GB/s")
    rows = []
    for i, p0 in enumerate(rep.bandwidths[0].predictions):
        row: list[Any] = [p0.tokens, p0.recompute_s]
        for bv in rep.bandwidths:
            p = bv.predictions[i]
            mark = "[green]load[/]" if p.verdict == "load" else "[red]recompute[/]"
            row.append(f"{p.load_s:.3f} {mark}")
        rows.append(row)
    cross = ", ".join(
        f"{bv.bandwidth_gbps:g} GB/s → {'never' if bv.crossover_tokens is None else f'>{bv.crossover_tokens:,.0f} tok'}"
        for bv in rep.bandwidths
    )
    caption = (
        f"s = {rep.bytes_per_token:,.1f} B/token (whole model"
        + (f"; {rep.bytes_per_token_per_rank:,.1f} per rank at tp {rep.tp}" if rep.tp > 1 else "")
        + f") · R = {rep.prefill_rate_tok_s:,.0f} tok/s · T0 = {rep.t0_s:g} s\n"
        f"B* = s·R = {rep.breakeven_gbps:.3f} GB/s · n* = R·T0 = {rep.min_hit_tokens:,.0f} tokens\n"
        f"loading wins: {cross}"
    )
    render.table(rep.name, cols, rows, caption=caption)
