"""The ``probe`` command line: a thin layer over the library.

Each command parses its options, builds one config object, calls one library function and
renders the result. A ``ProbeError`` anywhere becomes one line on stderr and exit code 2, in
``main`` alone. Heavy libraries (torch, vllm, transformers, matplotlib) are imported inside the
library functions, so ``probe --help`` answers at once.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from mismatch_probe.errors import ProbeError

if TYPE_CHECKING:
    from mismatch_probe.metrics import MetricsConfig

DEFAULT_MAX_TOKENS = 96

app = typer.Typer(
    help="Measure the training-inference mismatch of a language model.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
models_app = typer.Typer(help="Prepare and build models.", no_args_is_help=True)
app.add_typer(models_app, name="models")

# --- metrics ----------------------------------------------------------------------------------

RolloutIsOpt = Annotated[
    str, typer.Option("--rollout-is", help="IS weight level: token, sequence or none.")
]
RolloutIsThresholdOpt = Annotated[
    str,
    typer.Option(
        "--rollout-is-threshold",
        help="IS bound: C truncates weights at C (TIS); L_U zeroes weights outside [L, U] "
        "(IcePop), e.g. 0.5_5.0.",
    ),
]
RolloutRsOpt = Annotated[
    str | None,
    typer.Option(
        "--rollout-rs",
        help="Rejection options, comma-separated: token_k1..3, seq_sum_k1..3, seq_mean_k1..3, "
        "seq_max_k2, seq_max_k3 (a token survives when every option keeps it).",
    ),
]
RolloutRsThresholdOpt = Annotated[
    str | None,
    typer.Option(
        "--rollout-rs-threshold",
        help="One threshold for all options or one per option, comma-separated: L_U or X "
        "(= 1/X_X) for k1 options, one number U for k2/k3 options.",
    ),
]
BatchNormalizeOpt = Annotated[
    bool,
    typer.Option("--batch-normalize", help="Also report the IS batch normalisation factor."),
]
PresetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--preset",
        help="Correction preset to evaluate, repeatable (default: all): token_is, seq_is, "
        "token_icepop, seq_is_rs, geo_rs, k3_rs, geo_rs_token_tis, geo_rs_seq_tis, "
        "k3_rs_token_tis, k3_rs_seq_tis.",
    ),
]
SettingOpt = Annotated[
    str | None,
    typer.Option(
        "--setting", help="Use only the rows of this setting (needed when there are several)."
    ),
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print one flat JSON object (spec names) instead of tables.")
]


@app.command("metrics")
def metrics_command(
    path: Annotated[Path, typer.Argument(help="Run directory or token-store Parquet file.")],
    rollout_is: RolloutIsOpt = "token",
    rollout_is_threshold: RolloutIsThresholdOpt = "2.0",
    rollout_rs: RolloutRsOpt = None,
    rollout_rs_threshold: RolloutRsThresholdOpt = None,
    batch_normalize: BatchNormalizeOpt = False,
    preset: PresetOpt = None,
    setting: SettingOpt = None,
    json_output: JsonOpt = False,
) -> None:
    """Compute verl's rollout-correction metrics and our diagnostics for a token store."""
    import json

    from mismatch_probe.metrics import compute_metrics, render_metrics

    cfg = _metrics_config(
        rollout_is, rollout_is_threshold, rollout_rs, rollout_rs_threshold, batch_normalize, preset
    )
    result = compute_metrics(path, cfg, setting=setting)
    if json_output:
        print(json.dumps(result.flat(), allow_nan=False))
    else:
        render_metrics(result, _stdout_console())


def _stdout_console() -> Console:
    """Results go to stdout; wide when it is not a terminal (logs, CI), so tables don't wrap."""
    return Console() if sys.stdout.isatty() else Console(width=140)


def main() -> None:
    """Console-script entry point: run the app, turning ``ProbeError`` into exit code 2."""
    try:
        code = app(standalone_mode=False)  # typer.Exit(n) comes back as n in this mode
    except ProbeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except (typer.Abort, KeyboardInterrupt):
        print("aborted", file=sys.stderr)
        raise SystemExit(130) from None
    except typer.Exit as exc:
        raise SystemExit(exc.exit_code) from None
    except typer.TyperException as exc:  # usage errors: unknown option, bad value
        format_message = getattr(exc, "format_message", None)
        message = format_message() if format_message else str(exc)
        print(f"error: {' '.join(message.split())}", file=sys.stderr)
        raise SystemExit(2) from None
    if isinstance(code, int) and code:
        raise SystemExit(code)


# --- reports ----------------------------------------------------------------------------------

RunDirArg = Annotated[Path, typer.Argument(help="Run directory written by probe scan.")]
CompareOutOpt = Annotated[
    Path | None,
    typer.Option(
        "--out",
        help="Directory for compare.md and the overlaid plots "
        "(default: reports/compare-<timestamp>/).",
    ),
]
MaxBoundOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--max", help="METRIC=VALUE: fail when METRIC is above VALUE, e.g. k3_kl=1e-3; repeatable."
    ),
]
MinBoundOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--min",
        help="METRIC=VALUE: fail when METRIC is below VALUE, e.g. prob_pearson=0.99; repeatable.",
    ),
]


def _metrics_config(
    rollout_is: str,
    rollout_is_threshold: str,
    rollout_rs: str | None,
    rollout_rs_threshold: str | None,
    batch_normalize: bool,
    preset: list[str] | None,
) -> MetricsConfig:
    """The ``MetricsConfig`` of the shared metric options."""
    from mismatch_probe.metrics import PRESETS, MetricsConfig

    return MetricsConfig(
        rollout_is=rollout_is,
        rollout_is_threshold=rollout_is_threshold,
        rollout_rs=rollout_rs,
        rollout_rs_threshold=rollout_rs_threshold,
        batch_normalize=batch_normalize,
        presets=tuple(preset) if preset is not None else tuple(PRESETS),
    )


def _print_paths(console: Console, paths: dict[str, Path]) -> None:
    for name, path in paths.items():
        console.print(f"  {name:<16} {path}", highlight=False, soft_wrap=True)


@app.command()
def report(
    run_dir: RunDirArg,
    rollout_is: RolloutIsOpt = "token",
    rollout_is_threshold: RolloutIsThresholdOpt = "2.0",
    rollout_rs: RolloutRsOpt = None,
    rollout_rs_threshold: RolloutRsThresholdOpt = None,
    batch_normalize: BatchNormalizeOpt = False,
    preset: PresetOpt = None,
) -> None:
    """Re-render a run's terminal report, plots, report.md and metrics.json from its files.

    No model is needed; metrics are recomputed when the options differ from metrics.json's.
    """
    from mismatch_probe.report import load_report, render, write_outputs

    cfg = _metrics_config(
        rollout_is, rollout_is_threshold, rollout_rs, rollout_rs_threshold, batch_normalize, preset
    )
    ctx, entries = load_report(run_dir, cfg)
    paths = write_outputs(ctx, entries)
    console = _stdout_console()
    render(ctx, entries, console)
    _print_paths(console, paths)


@app.command()
def compare(
    run_dirs: Annotated[
        list[Path], typer.Argument(help="Run directories; ratios are to the first one.")
    ],
    out: CompareOutOpt = None,
) -> None:
    """Compare runs: key metrics with ratios to the first run, overlaid plots, compare.md.

    Warns when the runs differ in model, prompts or sampling.
    """
    from mismatch_probe.report.compare import (
        default_out_dir,
        load_comparison,
        render_comparison,
        write_comparison,
    )

    comparison = load_comparison(run_dirs)
    paths = write_comparison(comparison, out or default_out_dir())
    console = _stdout_console()
    render_comparison(comparison, console)
    _print_paths(console, paths)


@app.command()
def check(run_dir: RunDirArg, max_bound: MaxBoundOpt = None, min_bound: MinBoundOpt = None) -> None:
    """Check metric bounds (for CI): exit 0 when all hold, 1 when any fails, 2 on bad usage."""
    from mismatch_probe.report.check import check_run, parse_bounds, render_check

    results = check_run(run_dir, parse_bounds(max_bound or [], min_bound or []))
    render_check(results, _stdout_console())
    if not all(r.passed for r in results):
        raise typer.Exit(1)


# --- scan and models --------------------------------------------------------------------------
# Options are declared once here and shared by every command that takes them.

ModelOpt = Annotated[
    Path | None,
    typer.Option(
        "--model",
        help="Local transformers checkpoint directory, or a .gguf file (converted once into "
        "the cache). Default: the embedded SmolLM2-135M-Instruct.",
    ),
]
PromptsOpt = Annotated[
    Path | None,
    typer.Option(
        "--prompts",
        help="JSONL prompts file: one object a line with 'prompt' (text) or 'messages' (chat). "
        "Default: the bundled prompts/default.jsonl.",
    ),
]
NumPromptsOpt = Annotated[
    int | None, typer.Option("--num-prompts", help="Use only the first N prompts.")
]
SamplesOpt = Annotated[
    int, typer.Option("--samples-per-prompt", help="Responses sampled per prompt.")
]
MaxTokensOpt = Annotated[int, typer.Option("--max-tokens", help="Maximum response length.")]
TemperatureOpt = Annotated[float, typer.Option("--temperature", help="Sampling temperature.")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass; 1 disables.")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens; -1 off.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Base seed; each request gets its own.")]
LogprobsModeOpt = Annotated[
    str,
    typer.Option(
        "--logprobs-mode",
        help="processed: log-probs after temperature/top-k/top-p (what RL frameworks use); "
        "raw: before any processing. The rescoring follows the same mode.",
    ),
]
RolloutDtypeOpt = Annotated[
    str,
    typer.Option(
        "--rollout-dtype",
        help="vLLM dtype(s): float32, float16, bfloat16; a comma list runs each as a setting.",
    ),
]
TrainDtypeOpt = Annotated[
    str,
    typer.Option(
        "--train-dtype",
        help="Training-side dtype(s): float32, float16, bfloat16; a comma list runs each.",
    ),
]
KvCacheDtypeOpt = Annotated[
    str,
    typer.Option(
        "--kv-cache-dtype",
        help="vLLM KV-cache dtype(s): auto, fp8, fp8_e4m3, fp8_e5m2 (comma list).",
    ),
]
QuantizationOpt = Annotated[
    str,
    typer.Option(
        "--quantization",
        help="vLLM weight quantization(s): none, fp8 (comma list; fp8 needs a GPU backend).",
    ),
]
LmHeadFp32Opt = Annotated[
    str,
    typer.Option(
        "--lm-head-fp32",
        help="Run vLLM's LM head in float32 (hf_overrides head_dtype): off, on, or off,on.",
    ),
]
RoutingReplayOpt = Annotated[
    str,
    typer.Option(
        "--routing-replay",
        help="MoE models: none (the trainer routes itself), rollout (R3: force the engine's "
        "routes in the training forward), or none,rollout to see what R3 removes.",
    ),
]
SameTokensOpt = Annotated[
    bool,
    typer.Option(
        "--same-tokens",
        help="Score the first rollout setting's tokens in every engine (forced continuation, "
        "raw prefill log-probs), so settings differ only by numerics.",
    ),
]
StrictOpt = Annotated[
    bool,
    typer.Option("--strict", help="A setting the backend cannot run is an error (exit 2)."),
]
ChatOpt = Annotated[
    bool | None,
    typer.Option(
        "--chat/--no-chat",
        help="Apply the tokenizer's chat template (default: on when the tokenizer has one).",
    ),
]
OutOpt = Annotated[
    Path | None,
    typer.Option("--out", help="Output directory (default: reports/<model>-<timestamp>/)."),
]
VllmArgOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--vllm-arg",
        help="Extra vLLM engine argument key=value (value parsed as JSON when it can be), "
        "repeatable, e.g. --vllm-arg tensor_parallel_size=2 --vllm-arg kv_cache_dtype=fp8.",
    ),
]
BatchTokensOpt = Annotated[
    int, typer.Option("--batch-tokens", help="Padded tokens per rescoring forward pass.")
]
FlipEpsOpt = Annotated[
    float | None,
    typer.Option(
        "--flip-eps",
        help="Top-k/top-p boundary margin under which a token is flagged as a support flip "
        "(default by rollout dtype: fp32 1e-4, fp16 1e-3, bf16 8e-3).",
    ),
]


@app.command()
def scan(
    model: ModelOpt = None,
    prompts: PromptsOpt = None,
    num_prompts: NumPromptsOpt = None,
    samples_per_prompt: SamplesOpt = 1,
    max_tokens: MaxTokensOpt = DEFAULT_MAX_TOKENS,
    temperature: TemperatureOpt = 1.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = -1,
    seed: SeedOpt = 0,
    logprobs_mode: LogprobsModeOpt = "processed",
    rollout_dtype: RolloutDtypeOpt = "bfloat16",
    train_dtype: TrainDtypeOpt = "float32",
    kv_cache_dtype: KvCacheDtypeOpt = "auto",
    quantization: QuantizationOpt = "none",
    lm_head_fp32: LmHeadFp32Opt = "off",
    routing_replay: RoutingReplayOpt = "none",
    same_tokens: SameTokensOpt = False,
    strict: StrictOpt = False,
    chat: ChatOpt = None,
    out: OutOpt = None,
    vllm_arg: VllmArgOpt = None,
    batch_tokens: BatchTokensOpt = 8192,
    flip_eps: FlipEpsOpt = None,
) -> None:
    """Generate rollouts with vLLM, rescore the same tokens with transformers, measure."""
    from mismatch_probe.config import ScanConfig
    from mismatch_probe.report.terminal import render_run
    from mismatch_probe.rollout import parse_engine_args
    from mismatch_probe.sampling import SamplingSpec
    from mismatch_probe.scan import run_scan
    from mismatch_probe.settings import parse_on_off, split_list
    from mismatch_probe.summary import render_summary

    if logprobs_mode not in ("processed", "raw"):
        raise ProbeError(f"--logprobs-mode: processed or raw, got {logprobs_mode!r}")
    sampling = SamplingSpec(temperature, top_p, top_k, max_tokens, seed, logprobs_mode)  # type: ignore[arg-type]
    cfg = ScanConfig(
        model=model,
        prompts=prompts,
        num_prompts=num_prompts,
        samples_per_prompt=samples_per_prompt,
        sampling=sampling,
        rollout_dtypes=split_list(rollout_dtype),
        train_dtypes=split_list(train_dtype),
        kv_cache_dtypes=split_list(kv_cache_dtype),
        quantizations=split_list(quantization),
        lm_head_fp32=parse_on_off(lm_head_fp32, "--lm-head-fp32"),
        routing_replay=split_list(routing_replay),
        same_tokens=same_tokens,
        strict=strict,
        chat=chat,
        out=out,
        vllm_args=parse_engine_args(vllm_arg or []),
        batch_tokens=batch_tokens,
        flip_eps=flip_eps,
    )
    result = run_scan(cfg, Console(stderr=True))
    console = _stdout_console()
    render_run(result.report, console)
    render_summary(result, console)


@models_app.command("prepare")
def models_prepare(
    force: Annotated[bool, typer.Option("--force", help="Convert again even if cached.")] = False,
) -> None:
    """Convert the embedded SmolLM2-135M-Instruct GGUF into an fp32 checkpoint in the cache."""
    from mismatch_probe.models import prepare_default_model

    print(prepare_default_model(force=force))


@models_app.command("tiny")
def models_tiny(
    out: Annotated[Path, typer.Argument(help="Directory to write the checkpoint to.")],
    arch: Annotated[
        str,
        typer.Option(
            "--arch",
            help="Architecture: llama (dense); qwen3_moe or mixtral (MoE: 8 experts, top-2).",
        ),
    ] = "llama",
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random weights.")] = 0,
) -> None:
    """Build a tiny random-weight checkpoint (for tests and trying the tool)."""
    from mismatch_probe.tiny import build_tiny_model

    print(build_tiny_model(out, arch=arch, seed=seed))


if __name__ == "__main__":
    main()
