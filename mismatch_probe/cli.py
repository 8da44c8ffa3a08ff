"""The ``probe`` command line: a thin layer over the library.

Each command parses its options, builds one config object, calls one library function and
renders the result. A ``ProbeError`` anywhere becomes one line on stderr and exit code 2, in
``main`` alone. Heavy libraries (torch, vllm, transformers, matplotlib) are imported inside the
library functions, so ``probe --help`` answers at once.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from mismatch_probe.errors import ProbeError

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

    from mismatch_probe.metrics import PRESETS, MetricsConfig, compute_metrics, render_metrics

    cfg = MetricsConfig(
        rollout_is=rollout_is,
        rollout_is_threshold=rollout_is_threshold,
        rollout_rs=rollout_rs,
        rollout_rs_threshold=rollout_rs_threshold,
        batch_normalize=batch_normalize,
        presets=tuple(preset) if preset is not None else tuple(PRESETS),
    )
    result = compute_metrics(path, cfg, setting=setting)
    if json_output:
        print(json.dumps(result.flat(), allow_nan=False))
    else:
        render_metrics(result, Console())



def main() -> None:
    """Console-script entry point: run the app, turning ``ProbeError`` into exit code 2."""
    try:
        app(standalone_mode=False)
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
    str, typer.Option("--rollout-dtype", help="vLLM dtype: float32, float16 or bfloat16.")
]
TrainDtypeOpt = Annotated[
    str,
    typer.Option("--train-dtype", help="Training-side dtype: float32, float16 or bfloat16."),
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
    chat: ChatOpt = None,
    out: OutOpt = None,
    vllm_arg: VllmArgOpt = None,
    batch_tokens: BatchTokensOpt = 8192,
    flip_eps: FlipEpsOpt = None,
) -> None:
    """Generate rollouts with vLLM, rescore the same tokens with transformers, measure."""
    from mismatch_probe.config import ScanConfig
    from mismatch_probe.rollout import parse_engine_args
    from mismatch_probe.sampling import SamplingSpec
    from mismatch_probe.scan import run_scan
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
        rollout_dtype=rollout_dtype,
        train_dtype=train_dtype,
        chat=chat,
        out=out,
        vllm_args=parse_engine_args(vllm_arg or []),
        batch_tokens=batch_tokens,
        flip_eps=flip_eps,
    )
    render_summary(run_scan(cfg, Console(stderr=True)), Console())


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
    arch: Annotated[str, typer.Option("--arch", help="Architecture: llama.")] = "llama",
    seed: SeedOpt = 0,
) -> None:
    """Build a tiny random-weight checkpoint (for tests and trying the tool)."""
    from mismatch_probe.tiny import build_tiny_model

    print(build_tiny_model(out, arch=arch, seed=seed))


if __name__ == "__main__":
    main()
