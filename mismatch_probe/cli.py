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
from typing import Annotated

import typer
from rich.console import Console

from mismatch_probe import interrupt
from mismatch_probe.config import ScanConfig
from mismatch_probe.errors import ProbeError
from mismatch_probe.metrics.config import MetricsConfig
from mismatch_probe.options import (
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
    PromptsOpt,
    QuantizationOpt,
    RolloutDtypeOpt,
    RoutingReplayOpt,
    RunDirArg,
    SameTokensOpt,
    SamplesOpt,
    SeedOpt,
    SettingOpt,
    StrictOpt,
    TemperatureOpt,
    TopKOpt,
    TopPOpt,
    TrainDtypeOpt,
    VerboseOpt,
    VllmArgOpt,
    metric_options,
)
from mismatch_probe.sampling import SamplingSpec
from mismatch_probe.settings import ON_OFF

SCAN = ScanConfig()  # the defaults of every scan option
ON_OFF_NAME = {value: name for name, value in ON_OFF.items()}

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
@metric_options
def metrics_command(
    path: Annotated[Path, typer.Argument(help="Run directory or token-store Parquet file.")],
    metrics_config: MetricsConfig,
    setting: SettingOpt = None,
    json_output: JsonOpt = False,
) -> None:
    """Compute verl's rollout-correction metrics and our diagnostics for a token store."""
    import json

    from mismatch_probe.metrics import compute_metrics
    from mismatch_probe.report.metrics_table import render_metrics

    result = compute_metrics(path, metrics_config, setting=setting)
    if json_output:
        print(json.dumps(result.flat(), allow_nan=False))
    else:
        render_metrics(result, _stdout_console())


def _stdout_console() -> Console:
    """Results go to stdout; wide when it is not a terminal (logs, CI), so tables don't wrap."""
    return Console() if sys.stdout.isatty() else Console(width=140)


def main() -> None:
    """Console-script entry point: run the app, turning ``ProbeError`` into exit code 2 and
    an interrupt (SIGINT, SIGTERM) into one line and exit code 130 or 143."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are local paths; never a hub
    from mismatch_probe.engine_process import descendants

    before = set(descendants())
    try:
        with interrupt.handled():
            code = app(standalone_mode=False)  # typer.Exit(n) comes back as n in this mode
    except interrupt.Interrupted as exc:
        _stop_engines(before)
        print(exc.message(), file=sys.stderr)
        raise SystemExit(exc.exit_code) from None
    except ProbeError as exc:
        _stop_engines(before)
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except (typer.Abort, KeyboardInterrupt):
        _stop_engines(before)
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


def _stop_engines(before: set[int]) -> None:
    """No engine process outlives a command that failed or was interrupted: what the command
    started and is still running is stopped (processes that were there before are left)."""
    from mismatch_probe.engine_process import stop_children

    stop_children(exclude=before)


# --- reports ----------------------------------------------------------------------------------


def _print_paths(console: Console, paths: dict[str, Path]) -> None:
    for name, path in paths.items():
        console.print(f"  {name:<16} {path}", highlight=False, soft_wrap=True)


@app.command()
@metric_options
def report(run_dir: RunDirArg, metrics_config: MetricsConfig) -> None:
    """Re-render a run's terminal report, plots, report.md and metrics.json from its files.

    No model is needed; metrics are recomputed when the options differ from metrics.json's.
    """
    from mismatch_probe.report import load_report, render, write_outputs

    ctx, entries = load_report(run_dir, metrics_config)
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
    model: ModelOpt = SCAN.model,
    prompts: PromptsOpt = SCAN.prompts,
    num_prompts: NumPromptsOpt = SCAN.num_prompts,
    samples_per_prompt: SamplesOpt = SCAN.samples_per_prompt,
    max_tokens: MaxTokensOpt = SCAN.sampling.max_tokens,
    temperature: TemperatureOpt = SCAN.sampling.temperature,
    top_p: TopPOpt = SCAN.sampling.top_p,
    top_k: TopKOpt = SCAN.sampling.top_k,
    seed: SeedOpt = SCAN.sampling.seed,
    logprobs_mode: LogprobsModeOpt = SCAN.sampling.logprobs_mode,
    rollout_dtype: RolloutDtypeOpt = ",".join(SCAN.rollout_dtypes),
    train_dtype: TrainDtypeOpt = ",".join(SCAN.train_dtypes),
    kv_cache_dtype: KvCacheDtypeOpt = ",".join(SCAN.kv_cache_dtypes),
    quantization: QuantizationOpt = ",".join(SCAN.quantizations),
    lm_head_fp32: LmHeadFp32Opt = ",".join(ON_OFF_NAME[v] for v in SCAN.lm_head_fp32),
    routing_replay: RoutingReplayOpt = ",".join(SCAN.routing_replay),
    same_tokens: SameTokensOpt = SCAN.same_tokens,
    strict: StrictOpt = SCAN.strict,
    chat: ChatOpt = SCAN.chat,
    out: OutOpt = SCAN.out,
    vllm_arg: VllmArgOpt = None,
    batch_tokens: BatchTokensOpt = SCAN.batch_tokens,
    flip_eps: FlipEpsOpt = SCAN.flip_eps,
    verbose: VerboseOpt = SCAN.verbose,
) -> None:
    """Generate rollouts with vLLM, rescore the same tokens with transformers, measure.

    Defaults and validation come from ``ScanConfig`` and ``SamplingSpec``: the library and the
    command line cannot disagree.
    """
    from mismatch_probe.report.summary import render_summary
    from mismatch_probe.report.terminal import render_run
    from mismatch_probe.rollout import parse_engine_args
    from mismatch_probe.scan import run_scan
    from mismatch_probe.settings import parse_on_off, split_list

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
        verbose=verbose,
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
