"""The ``probe`` command line: a thin layer over the library.

Each command parses its options, builds one config object, calls one library function and
renders the result. A ``ProbeError`` anywhere becomes one line on stderr and exit code 2, in
``main`` alone. Heavy libraries (torch, vllm, transformers, matplotlib) are imported inside the
library functions, so ``probe --help`` answers at once.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from mismatch_probe.errors import ProbeError
from mismatch_probe.options import (
    BatchNormalizeOpt,
    BatchTokensOpt,
    ChatOpt,
    CompareOutOpt,
    FlipEpsOpt,
    JsonOpt,
    KvCacheDtypeOpt,
    LmHeadFp32Opt,
    LogprobsModeOpt,
    MaxBoundOpt,
    MaxTokensOpt,
    MinBoundOpt,
    ModelOpt,
    NumPromptsOpt,
    OutOpt,
    PresetOpt,
    PromptsOpt,
    QuantizationOpt,
    RayOpt,
    ResumeOpt,
    RolloutDtypeOpt,
    RolloutIsOpt,
    RolloutIsThresholdOpt,
    RolloutRsOpt,
    RolloutRsThresholdOpt,
    RoutingReplayOpt,
    RunDirArg,
    SameTokensOpt,
    SamplesOpt,
    SeedOpt,
    SettingOpt,
    ShardsOpt,
    StrictOpt,
    TemperatureOpt,
    TopKOpt,
    TopPOpt,
    TrainDeviceMapOpt,
    TrainDtypeOpt,
    VllmArgOpt,
)

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
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are local paths; never a hub
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
    batch_tokens: BatchTokensOpt = 2048,
    flip_eps: FlipEpsOpt = None,
    train_device_map: TrainDeviceMapOpt = None,
    shards: ShardsOpt = 1,
    ray: RayOpt = None,
    resume: ResumeOpt = False,
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
        train_device_map=train_device_map,
        shards=shards,
        ray=ray,
        resume=resume,
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
