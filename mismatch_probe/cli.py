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
from rich.text import Text

from mismatch_probe import interrupt
from mismatch_probe.cli_help import (
    ProbeCommand,
    ProbeGroup,
    epilog,
    print_version,
    show_help_without_command,
)
from mismatch_probe.errors import ProbeError, printable
from mismatch_probe.metrics.config import MetricsConfig
from mismatch_probe.options import (
    AcceptOpt,
    AllowDifferentOpt,
    AttributeOpt,
    AuditEveryOpt,
    BaselineOpt,
    BatchTokensOpt,
    ChatOpt,
    CompareOutOpt,
    ConvertAgainOpt,
    ExactOpt,
    ExitOnAlertOpt,
    ExportOutOpt,
    ExportPathOpt,
    ExportTargetOpt,
    ExportToOpt,
    FlipEpsOpt,
    ForceOpt,
    FormatArg,
    FormatOpt,
    FromCkptOpt,
    IngestModelOpt,
    IngestOutOpt,
    IntervalOpt,
    JsonOpt,
    KvCacheDtypeOpt,
    LayersOpt,
    LayersSequencesOpt,
    LmHeadFp32Opt,
    LogprobsModeOpt,
    MaxBoundOpt,
    MaxIncreaseOpt,
    MaxLinkOpt,
    MaxTokensOpt,
    MinBoundOpt,
    ModelOpt,
    NumPromptsOpt,
    OnAlertOpt,
    OutOpt,
    ProjectOpt,
    PromptIdOpt,
    PromptsOpt,
    QuantizationOpt,
    RayOpt,
    RayTimeoutOpt,
    RefitKvCacheDtypeOpt,
    RefitMethodOpt,
    RefitOutOpt,
    RefitPromptsOpt,
    RefitRolloutDtypeOpt,
    RefitTrainDtypeOpt,
    ResumeOpt,
    RolloutDtypeOpt,
    RoutingReplayOpt,
    RunDirArg,
    SameTokensOpt,
    SamplesOpt,
    SeedOpt,
    SelftestOutOpt,
    SettingOpt,
    SettingsOpt,
    SettleOpt,
    ShardsOpt,
    SignificanceOpt,
    SourceArg,
    StaleModelOpt,
    StepOpt,
    StepsOpt,
    StrictOpt,
    TemperatureOpt,
    TinyArchOpt,
    TinyOutArg,
    TinySeedOpt,
    ToCkptOpt,
    TopKOpt,
    TopPOpt,
    TrainDeviceMapOpt,
    TrainDtypeOpt,
    TrustPickleOpt,
    UntilOpt,
    VerboseOpt,
    VllmArgOpt,
    WandbRunOpt,
    WatchModelOpt,
    metric_options,
)
from mismatch_probe.pipeline.config import ScanConfig
from mismatch_probe.settings import ON_OFF

SCAN = ScanConfig()  # the defaults of every scan option
RAY_LOCAL = "local"  # what a bare --ray means
ON_OFF_NAME = {value: name for name, value in ON_OFF.items()}

app = typer.Typer(
    cls=ProbeGroup,
    help="Measure the training-inference mismatch of a language model: sample with vLLM, "
    "rescore the same tokens with transformers, report and gate the difference.",
    add_completion=False,
    pretty_exceptions_enable=False,
)
models_app = typer.Typer(cls=ProbeGroup, help="Prepare and build models.")
app.add_typer(models_app, name="models")


@app.callback(invoke_without_command=True)
def _probe(
    ctx: typer.Context,
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            metavar="",
            callback=print_version,
            is_eager=True,
            help="Print probe's version and exit.",
        ),
    ] = False,
) -> None:
    show_help_without_command(ctx)


@models_app.callback(invoke_without_command=True)
def _models(ctx: typer.Context) -> None:
    show_help_without_command(ctx)


# --- metrics ----------------------------------------------------------------------------------


@app.command("metrics", cls=ProbeCommand, epilog=epilog("metrics"))
@metric_options
def metrics_command(
    path: Annotated[
        Path,
        typer.Argument(metavar="RUN_DIR|FILE", help="Run directory or token-store Parquet file."),
    ],
    metrics_config: MetricsConfig,
    setting: SettingOpt = None,
    step: StepOpt = None,
    json_output: JsonOpt = False,
) -> None:
    """Compute verl's rollout-correction metrics and our diagnostics for a token store."""
    import json

    from mismatch_probe.metrics import compute_metrics
    from mismatch_probe.metrics.steps import resolve_step
    from mismatch_probe.report.integrity import integrity_json, integrity_text
    from mismatch_probe.report.metrics_table import render_metrics
    from mismatch_probe.rundir.integrity import run_integrity
    from mismatch_probe.rundir.layers import first_divergent
    from mismatch_probe.store import resolve_tokens_path

    number = None if step is None else resolve_step(resolve_tokens_path(path), step)
    integrity = run_integrity(path)
    result = compute_metrics(path, metrics_config, setting=setting, step=number)
    if json_output:
        from mismatch_probe.metrics.recommend import recommend

        sweep = result.tables["threshold_sweep"]
        found = recommend(
            result.flat(), result.config.describe(), sweep, integrity.blocking_checks(number)
        )
        data = {
            "integrity": integrity_json(integrity, number),
            **result.flat(),
            "recommendation": found.to_dict(),
            **first_divergent(path, setting),  # a run scanned with --layers
        }
        print(json.dumps(data, allow_nan=False))
    else:
        _stdout_console().print(integrity_text(integrity, number))
        if setting is not None:  # the checks run over the whole store, not one setting
            _stdout_console().print("(data integrity of the whole store, every setting)")
        render_metrics(result, _stdout_console())


# The width of stdout when it is no terminal (logs, CI) and COLUMNS names none: a precision
# matrix's grid (a column per health check, then the recommendation) fits without folding.
PLAIN_WIDTH = 180


def _stdout_console() -> Console:
    """Results go to stdout; wide when it is not a terminal (logs, CI), so tables don't wrap
    (``COLUMNS``, when set, is the width)."""
    if sys.stdout.isatty():
        return Console()
    columns = os.environ.get("COLUMNS", "")
    return Console(width=int(columns) if columns.isdigit() and int(columns) > 0 else PLAIN_WIDTH)


def main() -> None:
    """Console-script entry point: run the app, turning ``ProbeError`` (and any ``OSError``)
    into one line and exit code 2, and an interrupt (SIGINT, SIGTERM) into one line and exit
    code 130 or 143. No process the command started outlives a failure or an interrupt."""
    from mismatch_probe.engine.process import descendants
    from mismatch_probe.malloc import keep_freed_memory

    keep_freed_memory()
    before = set(descendants())
    try:
        with interrupt.handled():
            args = _bare_ray(sys.argv[1:])
            code = app(args, prog_name="probe", standalone_mode=False)  # typer.Exit(n) -> n
    except interrupt.Interrupted as exc:
        _stop_engines(before)
        print(exc.message(), file=sys.stderr)
        raise SystemExit(exc.exit_code) from None
    except ProbeError as exc:
        _stop_engines(before)
        print(f"error: {_one_line(str(exc))}", file=sys.stderr)
        raise SystemExit(2) from None
    except OSError as exc:  # a disk that fills or a file that vanishes mid-run: one line too
        from mismatch_probe.store import os_error_reason

        _stop_engines(before)
        where = f": {exc.filename}" if exc.filename else ""
        print(f"error: {_one_line(os_error_reason(exc) + where)}", file=sys.stderr)
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


def _one_line(text: str) -> str:
    """An error message as one line, its control characters escaped."""
    return printable(" ".join(text.split()))


def _bare_ray(args: list[str]) -> list[str]:
    """``--ray`` with no address means a local Ray instance (click options cannot take an
    optional value, so the bare flag is completed here)."""
    out = []
    for i, arg in enumerate(args):
        out.append(arg)
        if arg == "--ray" and (i + 1 == len(args) or args[i + 1].startswith("-")):
            out.append(RAY_LOCAL)
    return out


def _stop_engines(before: set[int]) -> None:
    """No engine process outlives a command that failed or was interrupted: what the command
    started and is still running is stopped (processes that were there before are left)."""
    from mismatch_probe.engine.process import stop_children

    stop_children(exclude=before)


# --- reports ----------------------------------------------------------------------------------


def _print_paths(console: Console, paths: dict[str, Path]) -> None:
    for name, path in paths.items():
        console.print(Text(f"  {name:<16} {printable(str(path))}"), soft_wrap=True)


@app.command(cls=ProbeCommand, epilog=epilog("report"))
@metric_options
def report(
    run_dir: RunDirArg,
    metrics_config: MetricsConfig,
    fmt: FormatOpt = "terminal",
    setting: SettingsOpt = None,
) -> None:
    """Re-render a run's terminal report, plots, report.md, report.html and metrics.json.

    No model is needed; metrics are recomputed when the options differ from metrics.json's.
    Every setting of a precision-matrix run is judged at the top.
    """
    from mismatch_probe.pipeline.publish import publish
    from mismatch_probe.report import render
    from mismatch_probe.report.comment import check_format, run_comment
    from mismatch_probe.rundir import load_report
    from mismatch_probe.rundir.trend_run import is_trend_run

    check_format(fmt)
    from mismatch_probe.rundir.refit import is_refit_run

    if is_refit_run(run_dir):  # probe refit: the audit and the links, no token store
        _report_refit(run_dir, fmt)
        return
    if is_trend_run(run_dir):  # probe ingest verl-log: the logged trend, no token store
        from mismatch_probe.report.trend_run import render_trend_run, write_trend_report
        from mismatch_probe.rundir.trend_run import load_trend_run

        view = load_trend_run(run_dir)
        written = write_trend_report(view)
        render_trend_run(view, _stdout_console())
        _print_paths(_stdout_console(), {"report": written})
        return
    import time

    with interrupt.stage("loading"):
        ctx, entries = load_report(run_dir, metrics_config, settings=tuple(setting or ()))
    interrupt.writing_to(run_dir, time.time())  # an interrupt names what was already written
    with interrupt.stage("reports"):
        paths = publish(ctx, entries)
    if fmt == "pr-comment":
        print(run_comment(ctx, entries), end="")
        return
    console = _stdout_console()
    render(ctx, entries, console)
    _print_paths(console, paths)


@app.command(cls=ProbeCommand, epilog=epilog("compare"))
def compare(
    run_dirs: Annotated[
        list[Path],
        typer.Argument(metavar="RUN_DIR", help="Run directories; ratios are to the first one."),
    ],
    out: CompareOutOpt = None,
    fmt: FormatOpt = "terminal",
    setting: SettingsOpt = None,
) -> None:
    """Compare runs: key metrics with ratios to the first run, overlaid plots, compare.md/.html.

    Warns when the runs differ in model, prompts, sampling or hardware. Precision-matrix runs
    are compared setting by setting, paired by name.
    """
    from mismatch_probe.gate.compare import default_out_dir, load_comparison
    from mismatch_probe.report.comment import check_format, comparison_comment
    from mismatch_probe.report.compare import render_comparison, write_comparison

    check_format(fmt)
    comparison = load_comparison(run_dirs, tuple(setting or ()), intervals=fmt == "pr-comment")
    paths = write_comparison(comparison, out or default_out_dir())
    if fmt == "pr-comment":
        print(comparison_comment(comparison), end="")
        return
    console = _stdout_console()
    render_comparison(comparison, console)
    _print_paths(console, paths)


@app.command(cls=ProbeCommand, epilog=epilog("check"))
def check(
    run_dir: RunDirArg,
    max_bound: MaxBoundOpt = None,
    min_bound: MinBoundOpt = None,
    baseline: BaselineOpt = None,
    max_increase: MaxIncreaseOpt = None,
    significance: SignificanceOpt = 0.95,
    allow_different: AllowDifferentOpt = False,
    step: StepOpt = None,
    setting: SettingsOpt = None,
    accept: AcceptOpt = None,
    exact: ExactOpt = False,
    max_link: MaxLinkOpt = 1e-6,
) -> None:
    """Check data integrity, metric bounds, and growth over a baseline run (for CI).

    Exit 0 when all hold, 1 when any fails, 2 on bad usage or runs that are not comparable
    (model, prompts, sampling or hardware differ).

    Every setting of a precision-matrix run is gated, each failing one named. A refit run
    (refit.json) fails on any mismatched, missing or unexpected tensor and on a refit or
    stale_prefix_cache link above --max-link.
    """
    from mismatch_probe.rundir.refit import is_refit_run

    if is_refit_run(run_dir):
        _check_refit(run_dir, max_link)
        return
    from mismatch_probe.gate.baseline import gate
    from mismatch_probe.gate.config import CheckConfig
    from mismatch_probe.report.gate import render_gate

    cfg = CheckConfig.from_options(
        run_dir,
        max_bound,
        min_bound,
        baseline,
        max_increase,
        significance,
        allow_different,
        step,
        setting,
        accept,
        exact,
    )
    result = gate(cfg)
    render_gate(result, _stdout_console())
    if not result.passed:
        raise typer.Exit(1)


def _report_refit(run_dir: Path, fmt: str) -> None:
    from mismatch_probe.gate.refit import gate_refit
    from mismatch_probe.report.refit import refit_comment, render_refit, write_refit_reports
    from mismatch_probe.rundir.refit import read_refit

    data = read_refit(run_dir)
    if fmt == "pr-comment":
        print(refit_comment(data, gate_refit(data)), end="")
        return
    paths = write_refit_reports(data, run_dir)
    console = _stdout_console()
    render_refit(data, console)
    _print_paths(console, paths)


def _check_refit(run_dir: Path, max_link: float) -> None:
    from mismatch_probe.gate.refit import gate_refit
    from mismatch_probe.report.refit import render_refit_gate
    from mismatch_probe.rundir.refit import read_refit

    result = gate_refit(read_refit(run_dir), max_link)
    render_refit_gate(result, _stdout_console())
    if not result.passed:
        raise typer.Exit(1)


@app.command(cls=ProbeCommand, epilog=epilog("refit"))
def refit(
    from_ckpt: FromCkptOpt,
    to_ckpt: ToCkptOpt,
    out: RefitOutOpt,
    method: RefitMethodOpt = "reload",
    prompts: RefitPromptsOpt = None,
    num_prompts: NumPromptsOpt = None,
    max_tokens: MaxTokensOpt = 32,
    seed: SeedOpt = 0,
    rollout_dtype: RefitRolloutDtypeOpt = "float32",
    train_dtype: RefitTrainDtypeOpt = "float32",
    kv_cache_dtype: RefitKvCacheDtypeOpt = "auto",
    vllm_arg: VllmArgOpt = None,
    force: ForceOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Push checkpoint B into an engine running A (as an RL step does), audit the weights it
    holds, and measure the stale prefix cache.

    Writes refit.json to --out: the weight audit (refitted vs fresh engine, and vs B's
    checkpoint through the engine's name mapping, with a negative control) and the links
    stale_prefix_cache, refit, engine_vs_train, cache_salt.
    """
    from mismatch_probe.engine.rollout import parse_engine_args
    from mismatch_probe.pipeline.refit import RefitConfig, run_refit
    from mismatch_probe.report.refit import render_refit

    cfg = RefitConfig(
        from_ckpt, to_ckpt, out, method, prompts, num_prompts, max_tokens, 1.0, seed,
        rollout_dtype, train_dtype, kv_cache_dtype, None, parse_engine_args(vllm_arg or []),
        force, verbose,
    )  # fmt: skip
    result = run_refit(cfg, Console(stderr=True))
    render_refit(result.data, _stdout_console())


# --- scan, ingest and models ------------------------------------------------------------------


@app.command(cls=ProbeCommand, epilog=epilog("scan"))
def scan(
    model: ModelOpt = SCAN.model,
    prompts: PromptsOpt = SCAN.prompts,
    num_prompts: NumPromptsOpt = SCAN.num_prompts,
    prompt_id: PromptIdOpt = None,
    samples_per_prompt: SamplesOpt = SCAN.samples_per_prompt,
    max_tokens: MaxTokensOpt = SCAN.sampling.max_tokens,
    temperature: TemperatureOpt = SCAN.sampling.temperature,
    top_p: TopPOpt = SCAN.sampling.top_p,
    top_k: TopKOpt = SCAN.sampling.top_k,
    seed: SeedOpt = SCAN.sampling.seed,
    logprobs_mode: LogprobsModeOpt = None,
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
    force: ForceOpt = SCAN.force,
    attribute: AttributeOpt = SCAN.attribute,
    stale_model: StaleModelOpt = SCAN.stale_model,
    train_device_map: TrainDeviceMapOpt = SCAN.train_device_map,
    shards: ShardsOpt = SCAN.shards,
    ray: RayOpt = SCAN.ray,
    ray_timeout: RayTimeoutOpt = SCAN.ray_timeout,
    resume: ResumeOpt = SCAN.resume,
    verbose: VerboseOpt = SCAN.verbose,
    layers: LayersOpt = SCAN.layers,
    layers_sequences: LayersSequencesOpt = SCAN.layers_sequences,
) -> None:
    """Generate rollouts with vLLM, rescore the same tokens with transformers, measure.

    Each combination of the precision options is a setting: one engine per rollout setting,
    one training model per training dtype. Writes the token store (Parquet), metrics, plots,
    report.md and report.html to --out.
    """
    options = dict(locals())  # the parameters above, by name: nothing else is defined yet
    from mismatch_probe.pipeline.scan import run_scan
    from mismatch_probe.pipeline.sharding import run_sharded
    from mismatch_probe.report.summary import render_scan

    cfg = ScanConfig.from_options(**options)
    result = (run_sharded if cfg.sharded else run_scan)(cfg, Console(stderr=True))
    render_scan(result, _stdout_console())


@app.command(cls=ProbeCommand, epilog=epilog("layers"))
def layers(
    run_dir: RunDirArg,
    layers_sequences: LayersSequencesOpt = None,
) -> None:
    """Compare both sides' residual streams layer by layer on an existing scan's tokens.

    Starts each rollout setting's engine again as the scan ran it and loads each training
    dtype: layers.json, then the reports re-rendered with their Layers section.
    """
    from mismatch_probe.pipeline.layers_run import run_layers
    from mismatch_probe.report.layers import render as render_layers

    data, paths = run_layers(run_dir, layers_sequences)
    render_layers(data, _stdout_console())
    _print_paths(_stdout_console(), paths)


@app.command(cls=ProbeCommand, epilog=epilog("ingest"))
def ingest(
    format_name: FormatArg,
    path: SourceArg,
    out: IngestOutOpt,
    model: IngestModelOpt = None,
    steps: StepsOpt = None,
    trust_pickle: TrustPickleOpt = False,
    temperature: TemperatureOpt = 1.0,
    batch_tokens: BatchTokensOpt = 2048,
) -> None:
    """Turn an RL framework's logs into a run: metrics per step and overall, a trend report.

    Formats without a training side (miles-parquet) are rescored with --model in float32 at
    --temperature (the logs do not record how the rollouts were sampled).
    """
    from mismatch_probe.ingest import IngestConfig, parse_steps, run_ingest
    from mismatch_probe.report.trend_run import render_ingest

    cfg = IngestConfig(
        format=format_name,
        path=path,
        out=out,
        model=model,
        steps=parse_steps(steps),
        trust_pickle=trust_pickle,
        temperature=temperature,
        batch_tokens=batch_tokens,
    )
    render_ingest(run_ingest(cfg), _stdout_console())


@app.command(cls=ProbeCommand, epilog=epilog("watch"))
def watch(
    format_name: FormatArg,
    path: SourceArg,
    out: IngestOutOpt,
    max_bound: MaxBoundOpt = None,
    min_bound: MinBoundOpt = None,
    on_alert: OnAlertOpt = None,
    until: UntilOpt = None,
    exit_on_alert: ExitOnAlertOpt = False,
    interval: IntervalOpt = 1.0,
    settle: SettleOpt = 30.0,
    audit_every: AuditEveryOpt = None,
    model: WatchModelOpt = None,
    steps: StepsOpt = None,
    trust_pickle: TrustPickleOpt = False,
    temperature: TemperatureOpt = 1.0,
    batch_tokens: BatchTokensOpt = 2048,
    export: ExportToOpt = None,
    export_out: ExportOutOpt = None,
    wandb_run: WandbRunOpt = None,
    project: ProjectOpt = "mismatch-probe",
) -> None:
    """Follow a training run while it is written: each complete step read once, measured,
    alerted on and appended to RUN.

    A live view in a terminal, one line per step otherwise. Stops at --until, at the first
    alert with --exit-on-alert (exit 1) or on Ctrl-C (exit 130); RUN is then a complete run.
    """
    options = dict(locals())  # the parameters above, by name: nothing else is defined yet
    from mismatch_probe.ingest.watch import WatchConfig, run_watch
    from mismatch_probe.report.watch import Display, render_end

    cfg = WatchConfig.from_options(**options)
    console = _stdout_console()
    result = run_watch(cfg, Display(console, live=sys.stdout.isatty()))
    render_end(result.out, result.steps, result.alerts, result.stopped, console)
    if result.exit_code:
        raise typer.Exit(result.exit_code)


@app.command("export", cls=ProbeCommand, epilog=epilog("export"))
def export_command(
    run_dir: RunDirArg,
    to: ExportTargetOpt,
    out: ExportPathOpt = None,
    wandb_run: WandbRunOpt = None,
    project: ProjectOpt = "mismatch-probe",
) -> None:
    """Write a run's metrics per step where users chart them: W&B, TensorBoard, trackio, or
    verl's file-logger JSONL.

    verl's names under rollout_corr/, NeMo-RL's under train/, ours under probe/; a histogram
    of log rho per step; the integrity findings and verdicts.
    """
    from mismatch_probe.export import ExportSpec, export_run

    spec = ExportSpec.from_options(to, out, wandb_run, project)
    result = export_run(run_dir, spec)
    console = _stdout_console()
    console.print(Text(result.summary()), highlight=False, soft_wrap=True)


@models_app.command("prepare", cls=ProbeCommand, epilog=epilog("models prepare"))
def models_prepare(
    force: ConvertAgainOpt = False,
) -> None:
    """Convert the embedded SmolLM2-135M-Instruct GGUF into an fp32 checkpoint in the cache."""
    from mismatch_probe.models import (
        default_model_dir,
        is_converted,
        prepare_default_model,
        prepared_message,
    )

    reused = not force and is_converted(default_model_dir())
    print(printable(prepared_message(prepare_default_model(force=force), reused)))


@models_app.command("tiny", cls=ProbeCommand, epilog=epilog("models tiny"))
def models_tiny(
    out: TinyOutArg,
    arch: TinyArchOpt = "llama",
    seed: TinySeedOpt = 0,
) -> None:
    """Build a tiny random-weight checkpoint (for tests and trying the tool)."""
    from mismatch_probe.models.tiny import build_tiny_model

    print(build_tiny_model(out, arch=arch, seed=seed))


@app.command(cls=ProbeCommand, epilog=epilog("selftest"))
def selftest(
    model: ModelOpt = None,
    out: SelftestOutOpt = None,
) -> None:
    """Prove the detectors fire: one real scan, then each fault of the table injected into a
    copy of its tokens and passed through the path that would see it.

    Prints each fault with what must catch it and what was seen; exit 0 only when every row
    holds (the clean control with no finding), 1 otherwise.
    """
    from mismatch_probe.report.selftest import render_selftest
    from mismatch_probe.selftest import run_selftest, work_dir

    console = _stdout_console()
    with work_dir(out) as work:
        result = run_selftest(model, work, Console(stderr=True))
    rows = [(r.fault.name, r.fault.injected, r.fault.expect, r.seen, r.held) for r in result.rows]
    render_selftest(rows, result.model, result.tokens, console)
    if not result.passed:
        raise typer.Exit(1)


if __name__ == "__main__":
    main()
