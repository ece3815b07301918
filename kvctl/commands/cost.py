"""``kvctl cost``: the paper's cost model from the command line (§4)."""

from __future__ import annotations

import click

from kvctl.core import cost

from kvctl.core import thresholds
from kvctl.commands.options import (
    ARRIVAL_RATE, BANDWIDTH_GBPS, BYTES_PER_TOKEN, BYTES_PER_TOKEN_HELP, CHUNK_TOKENS, LATENCY_S, PREFILL_RATE, PREFILL_RATE_HELP, PROMPT_GB, T0_HELP, T0_S, TOKENS, TP,
    TP_HELP, FiniteFloat, RenamedOption, bytes_per_token_options, output_options,
)
from kvctl.core.errors import InvalidInput
from kvctl.hooks import hookimpl
from kvctl.core.kvsize import DTYPE_BYTES, kv_size_from_file
from kvctl.views.cost import show_breakeven, show_fit_t0, show_kv_size, show_pairing, show_predict, show_rho


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
@click.option("--prefill-rate", type=PREFILL_RATE, required=True, help=f"{PREFILL_RATE_HELP}.")
@click.option("--t0", type=T0_S, help=f"{T0_HELP}; adds n* = R·T0.")
@output_options
def breakeven_cmd(bytes_per_token: float, tp: int, prefill_rate: float, t0: float | None, as_json: bool) -> None:
    """Break-even bandwidth B* = s·R of the whole tier, and n* = R·T0 when --t0 is given.

    With --tp N, also each rank's share: s/N bytes per token, and B*/N, what each
    of N instances (one per rank) must deliver.

    \b
    Example, the paper's GLM-5.3 FP8 on a B300 (B* ≈ 2.528 GB/s, n* ≈ 17 226 tokens):
      kvctl cost breakeven --bytes-per-token 48437.5 --prefill-rate 52200 --t0 0.33
    """
    show_breakeven(cost.summarize_breakeven(bytes_per_token, prefill_rate, t0, tp), as_json)


@cost_group.command("fit-t0")
@click.option("--latency-s", type=LATENCY_S, required=True, help="Measured time of one hit, seconds.")
@click.option("--prompt-gb", type=PROMPT_GB, help="KV bytes of that prompt in GB (or --prompt-tokens with --bytes-per-token).")
@click.option("--prompt-tokens", type=TOKENS, cls=RenamedOption, old=["--tokens"], help="Prompt length in tokens (with --bytes-per-token).")
@bytes_per_token_options(required=False)
@click.option("--tier-gbps", type=BANDWIDTH_GBPS, required=True, cls=RenamedOption, old=["--bandwidth-gbps"],
              help="Bandwidth B of the whole tier (all instances together) during the measurement, GB/s.")
@output_options
def fit_t0_cmd(latency_s: float, prompt_gb: float | None, prompt_tokens: int | None, bytes_per_token: float | None, tier_gbps: float, as_json: bool) -> None:
    """Fit the fixed per-hit cost: T0 = t_measured − n·s / B.

    \b
    Example, the paper's hit of 0.79 GB in 0.40 s from eight instances at 10.76 GB/s (T0 ≈ 0.327 s):
      kvctl cost fit-t0 --latency-s 0.40 --prompt-gb 0.79 --tier-gbps 10.76
    """
    prompt_bytes = _prompt_bytes(prompt_gb, prompt_tokens, bytes_per_token)
    t0 = cost.fit_t0(latency_s, prompt_bytes, tier_gbps)
    if t0 < 0:
        raise InvalidInput(f"the measured latency {latency_s}s is below the pure transfer time; check --tier-gbps")
    show_fit_t0(t0, latency_s, prompt_bytes, tier_gbps, as_json)


def _prompt_bytes(prompt_gb: float | None, tokens: int | None, bytes_per_token: float | None) -> float:
    if prompt_gb is not None:
        return prompt_gb * cost.GB
    if tokens is not None and bytes_per_token is not None:
        return tokens * bytes_per_token
    raise click.UsageError("give --prompt-gb, or --prompt-tokens with --bytes-per-token / --model-config")


@cost_group.command("predict")
@bytes_per_token_options(pass_tp=True)
@click.option("--prefill-rate", type=PREFILL_RATE, required=True, help=f"{PREFILL_RATE_HELP}.")
@click.option("--t0", type=T0_S, default=thresholds.PAPER_T0_S, show_default=True, help=f"{T0_HELP} (the paper's by default; fit yours with `kvctl cost fit-t0`).")
@click.option("--tier-gbps", type=BANDWIDTH_GBPS, required=True, cls=RenamedOption, old=["--bandwidth-gbps"],
              help="Bandwidth B of the whole tier in GB/s (all instances together).")
@click.option("--prompt-tokens", "tokens_opt", type=TOKENS, multiple=True, required=True, cls=RenamedOption, old=["--tokens"],
              help="Prompt lengths: --prompt-tokens 4096 16384 65536.")
@click.argument("more_tokens", nargs=-1, type=TOKENS, metavar="")
@output_options
def predict_cmd(bytes_per_token: float, tp: int, prefill_rate: float, t0: float, tier_gbps: float, tokens_opt: tuple[int, ...], more_tokens: tuple[int, ...], as_json: bool) -> None:
    """Per-length verdict: load from the tier, or recompute?

    \b
    Example, the paper's model on eight instances (recompute up to ~22 500 tokens, load above):
      kvctl cost predict --bytes-per-token 48437.5 --prefill-rate 52200 --tier-gbps 10.76 --prompt-tokens 4096 16384 65536
    """
    preds = cost.predict(_tokens(tokens_opt, more_tokens), bytes_per_token, prefill_rate, tier_gbps, t0)
    show_predict(preds, bytes_per_token, tp, prefill_rate, t0, tier_gbps, as_json)


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

    \b
    Example, the paper's one instance at 1.21 hits/s (ρ ≈ 1.12: unstable; 3 instances for ρ ≤ 0.5):
      kvctl cost rho --arrival-rate 1.21 --prompt-gb 0.79 --instance-gbps 0.85
    """
    res = cost.summarize_rho(arrival_rate, _prompt_bytes(prompt_gb, prompt_tokens, bytes_per_token), instance_gbps, rho_target, tp)
    show_rho(res, as_json, bytes_per_token if prompt_gb is None else None, tp)


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

    \b
    Example, GLM-5 in FLASHMLA_SPARSE's fp8 (61 464 B/token), a config of kvctl's checkout:
      kvctl cost kv-size --model-config configs/models/glm-5.json --dtype fp8
    """
    res = kv_size_from_file(config_path, dtype=dtype, chunk_tokens=chunk_tokens, tp=tp)
    show_kv_size(res, as_json)


@cost_group.command("report")
@click.option("--model-config", type=click.Path(dir_okay=False), help="config.json of the model (default: the paper's GLM-5.3 FP8 setup).")
@click.option("--bytes-per-token", type=BYTES_PER_TOKEN, help=BYTES_PER_TOKEN_HELP + " Instead of --model-config.")
@click.option("--dtype", type=click.Choice(sorted(DTYPE_BYTES)), help="KV dtype with --model-config.")
@click.option("--tp", type=TP, default=1, show_default=True, help=TP_HELP)
@click.option("--label", "name", cls=RenamedOption, old=["--name"], help="Label for this model/GPU pairing (the table's title).")
@click.option("--prefill-rate", type=PREFILL_RATE, help=f"{PREFILL_RATE_HELP}, on this GPU (required with a model).")
@click.option("--t0", type=T0_S, default=thresholds.PAPER_T0_S, show_default=True, help=f"{T0_HELP} (the paper's by default).")
@click.option("--tier-gbps", "bandwidths", type=BANDWIDTH_GBPS, multiple=True, cls=RenamedOption, old=["--bandwidth-gbps"],
              help="Whole-tier bandwidths to compare (repeatable; default 0.85, 1.71, 10.76).")
@click.option("--prompt-tokens", "tokens", type=TOKENS, multiple=True, cls=RenamedOption, old=["--tokens"], help="Prompt lengths: --prompt-tokens 4096 16384 (or repeated).")
@click.argument("more_tokens", nargs=-1, type=TOKENS, metavar="")
@output_options
def report_cmd(model_config: str | None, bytes_per_token: float | None, dtype: str | None, tp: int, name: str | None, prefill_rate: float | None, t0: float, bandwidths: tuple[float, ...], tokens: tuple[int, ...], more_tokens: tuple[int, ...], as_json: bool) -> None:
    """One table per model/GPU pairing: B*, n*, and load vs recompute over prompt lengths.

    With no model, reproduces the paper's GLM-5.3 FP8 / B300 setup.

    \b
    Examples, the paper's setup, then Llama 3.1 8B at 100 000 prefill tokens/s:
      kvctl cost report --prompt-tokens 4096 16384 65536
      kvctl cost report --model-config configs/models/llama-3.1-8b.json --prefill-rate 100000 --tier-gbps 2 --tier-gbps 10
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
    show_pairing(rep, as_json)
