"""Every ``probe`` option, declared once (``Annotated`` aliases) and shared by the commands
that take it, so that a name, its help text, its metavar and its help panel live in one place.

A metavar names what the value is (``N``, ``DIR``, ``METRIC=VALUE``) or lists the valid choices
(``[processed|raw]``); a flag has none. ``tests/test_cli_help.py`` checks the choices against the
library's own tables."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

# The help panels the options are grouped in (``rich_help_panel``), in the order a user reads them.
MODEL = "Model and prompts"
SAMPLING = "Sampling"
PRECISION = "Precision settings"
ATTRIBUTION = "Attribution"
SCALE = "Scale"
SELECTION = "What to read"
CORRECTION = "Correction (IS weights and rejection)"
BOUNDS = "Bounds"
BASELINE = "Baseline"
OUTPUT = "Output"
WATCH = "Watching"
PANELS: tuple[str, ...] = (MODEL, SELECTION, SAMPLING, PRECISION, ATTRIBUTION, SCALE)
PANELS += (CORRECTION, BOUNDS, BASELINE, WATCH, OUTPUT)  # output last on every command

RolloutIsOpt = Annotated[
    str,
    typer.Option(
        "--rollout-is",
        metavar="[token|sequence|none]",
        rich_help_panel=CORRECTION,
        help="IS weight level: token, sequence or none.",
    ),
]

RolloutIsThresholdOpt = Annotated[
    str,
    typer.Option(
        "--rollout-is-threshold",
        metavar="C|L_U",
        rich_help_panel=CORRECTION,
        help="IS bound: C truncates weights at C (TIS); L_U zeroes weights outside [L, U] "
        "(IcePop), e.g. 0.5_5.0.",
    ),
]

RolloutRsOpt = Annotated[
    str | None,
    typer.Option(
        "--rollout-rs",
        metavar="OPTION[,OPTION...]",
        rich_help_panel=CORRECTION,
        help="Rejection options, comma-separated: token_k1..3, seq_sum_k1..3, seq_mean_k1..3, "
        "seq_max_k2, seq_max_k3 (a token survives when every option keeps it).",
    ),
]

RolloutRsThresholdOpt = Annotated[
    str | None,
    typer.Option(
        "--rollout-rs-threshold",
        metavar="T[,T...]",
        rich_help_panel=CORRECTION,
        help="One threshold for all options or one per option, comma-separated: L_U or X "
        "(= 1/X_X) for k1 options, one number U for k2/k3 options.",
    ),
]

BatchNormalizeOpt = Annotated[
    bool,
    typer.Option(
        "--batch-normalize",
        metavar="",
        rich_help_panel=CORRECTION,
        help="Also report the IS batch normalisation factor.",
    ),
]

PresetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--preset",
        metavar="PRESET",
        rich_help_panel=CORRECTION,
        help="Correction preset to evaluate, repeatable (default: all): token_is, seq_is, "
        "token_icepop, seq_is_rs, geo_rs, k3_rs, geo_rs_token_tis, geo_rs_seq_tis, "
        "k3_rs_token_tis, k3_rs_seq_tis.",
    ),
]

SettingOpt = Annotated[
    str | None,
    typer.Option(
        "--setting",
        metavar="SETTING",
        rich_help_panel=SELECTION,
        help="Use only the rows of this setting (needed when there are several).",
    ),
]

JsonOpt = Annotated[
    bool,
    typer.Option(
        "--json",
        metavar="",
        rich_help_panel=OUTPUT,
        help="Print one JSON object instead of tables: 'integrity' (the data-integrity "
        "findings) first, then the metrics by their spec names and the recommendation.",
    ),
]

RunDirArg = Annotated[
    Path, typer.Argument(metavar="RUN_DIR", help="Run directory written by probe scan.")
]

SettingsOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--setting",
        metavar="SETTING",
        rich_help_panel=SELECTION,
        help="Only this setting of a precision-matrix run (default: every setting); "
        "repeatable, e.g. --setting 'rollout=bf16 | train=fp32'.",
    ),
]

CompareOutOpt = Annotated[
    Path | None,
    typer.Option(
        "--out",
        metavar="DIR",
        rich_help_panel=OUTPUT,
        help="Directory for compare.md and the overlaid plots "
        "(default: reports/compare-<timestamp>/).",
    ),
]

FormatOpt = Annotated[
    str,
    typer.Option(
        "--format",
        metavar="[terminal|pr-comment]",
        rich_help_panel=OUTPUT,
        help="What to print: terminal (tables) or pr-comment (GitHub Markdown for a pull "
        "request, no images, under 60,000 characters). The files are written either way.",
    ),
]

MaxBoundOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--max",
        metavar="METRIC=VALUE",
        rich_help_panel=BOUNDS,
        help="METRIC=VALUE: fail when METRIC is above VALUE, e.g. k3_kl=1e-3; repeatable.",
    ),
]

MinBoundOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--min",
        metavar="METRIC=VALUE",
        rich_help_panel=BOUNDS,
        help="METRIC=VALUE: fail when METRIC is below VALUE, e.g. prob_pearson=0.99; repeatable.",
    ),
]

BaselineOpt = Annotated[
    Path | None,
    typer.Option(
        "--baseline",
        metavar="RUN_DIR",
        rich_help_panel=BASELINE,
        help="Baseline run directory (e.g. the scan of the main branch) for --max-increase.",
    ),
]

MaxIncreaseOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--max-increase",
        metavar="METRIC=Fx|METRIC=+A",
        rich_help_panel=BASELINE,
        help="METRIC=FACTORx or METRIC=+AMOUNT: fail when METRIC grew past FACTOR times (or "
        "AMOUNT above) the baseline's, e.g. k3_kl=1.5x, f_tau_2=+0.001; repeatable.",
    ),
]

SignificanceOpt = Annotated[
    float,
    typer.Option(
        "--significance",
        metavar="LEVEL",
        rich_help_panel=BASELINE,
        help="Confidence level of the bootstrap intervals (k3_kl, kl, chi2_token, f_tau_2, "
        "...): an increase fails only when its whole interval is past the limit.",
    ),
]

AllowDifferentOpt = Annotated[
    bool,
    typer.Option(
        "--allow-different",
        metavar="",
        rich_help_panel=BASELINE,
        help="Gate against a baseline that differs in run kind (scan or ingested format), "
        "model config, prompts, sampling or hardware (CPU model and instruction sets, GPU) "
        "(otherwise exit 2 saying what differs).",
    ),
]

AcceptOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--accept",
        metavar="CHECK",
        rich_help_panel=BOUNDS,
        help="Accept a known data-integrity error (e.g. placeholder_logprob) instead of "
        "failing on it; repeatable.",
    ),
]

SelftestOutOpt = Annotated[
    Path | None,
    typer.Option(
        "--out",
        metavar="DIR",
        rich_help_panel=OUTPUT,
        help="Keep the scan and every faulty run directory here (must not exist or be empty; "
        "default: a temporary directory, removed afterwards).",
    ),
]

ExactOpt = Annotated[
    bool,
    typer.Option(
        "--exact",
        metavar="",
        rich_help_panel=BOUNDS,
        help="Fail (exit 1) unless the two sides are bitwise equal: parity/mismatch_count is 0 "
        "(for engines that claim batch invariance); names the first differing token.",
    ),
]

ModelOpt = Annotated[
    Path | None,
    typer.Option(
        "--model",
        metavar="PATH|ORG/NAME[@REV]",
        rich_help_panel=MODEL,
        help="Local transformers checkpoint directory, a .gguf file (converted once into "
        "the cache), or a Hugging Face hub id (org/name, org/name@revision) already in the "
        "local Hugging Face cache (HF_HUB_CACHE, HF_HOME; never downloaded). Default: the "
        "embedded SmolLM2-135M-Instruct.",
    ),
]

PromptsOpt = Annotated[
    Path | None,
    typer.Option(
        "--prompts",
        metavar="FILE",
        rich_help_panel=MODEL,
        help="JSONL prompts file: one object a line with 'prompt' (text) or 'messages' (chat). "
        "Default: the bundled prompts/default.jsonl.",
    ),
]

NumPromptsOpt = Annotated[
    int | None,
    typer.Option(
        "--num-prompts", metavar="N", rich_help_panel=MODEL, help="Use only the first N prompts."
    ),
]

PromptIdOpt = Annotated[
    list[int] | None,
    typer.Option(
        "--prompt-id",
        metavar="ID",
        rich_help_panel=MODEL,
        help="Scan only the prompt with this id (its 0-based index among the non-empty lines "
        "of the prompts file: the store's prompt_id), repeatable; each keeps its own sampling "
        "seeds, so a prompt's responses come out as in the full scan. Not with --num-prompts.",
    ),
]

SamplesOpt = Annotated[
    int,
    typer.Option(
        "--samples-per-prompt",
        metavar="N",
        rich_help_panel=SAMPLING,
        help="Responses sampled per prompt.",
    ),
]

MaxTokensOpt = Annotated[
    int,
    typer.Option(
        "--max-tokens", metavar="N", rich_help_panel=SAMPLING, help="Maximum response length."
    ),
]

TemperatureOpt = Annotated[
    float,
    typer.Option(
        "--temperature", metavar="T", rich_help_panel=SAMPLING, help="Sampling temperature."
    ),
]

TopPOpt = Annotated[
    float,
    typer.Option(
        "--top-p", metavar="P", rich_help_panel=SAMPLING, help="Nucleus sampling mass; 1 disables."
    ),
]

TopKOpt = Annotated[
    int,
    typer.Option(
        "--top-k",
        metavar="K",
        rich_help_panel=SAMPLING,
        help="Keep the k most likely tokens; -1 off.",
    ),
]

SeedOpt = Annotated[
    int,
    typer.Option(
        "--seed",
        metavar="SEED",
        rich_help_panel=SAMPLING,
        help="Base seed; each request gets its own.",
    ),
]

LogprobsModeOpt = Annotated[
    str | None,
    typer.Option(
        "--logprobs-mode",
        metavar="[processed|raw]",
        rich_help_panel=SAMPLING,
        help="processed: log-probs after temperature/top-k/top-p (what RL frameworks use); "
        "raw: before any processing. The rescoring follows the same mode. Default: processed "
        "(raw with --attribute, which needs it).",
    ),
]

RolloutDtypeOpt = Annotated[
    str,
    typer.Option(
        "--rollout-dtype",
        metavar="DTYPE[,DTYPE...]",
        rich_help_panel=PRECISION,
        help="vLLM dtype(s): float32, float16, bfloat16; a comma list runs each as a setting.",
    ),
]

TrainDtypeOpt = Annotated[
    str,
    typer.Option(
        "--train-dtype",
        metavar="DTYPE[,DTYPE...]",
        rich_help_panel=PRECISION,
        help="Training-side dtype(s): float32, float16, bfloat16; a comma list runs each.",
    ),
]

KvCacheDtypeOpt = Annotated[
    str,
    typer.Option(
        "--kv-cache-dtype",
        metavar="DTYPE[,DTYPE...]",
        rich_help_panel=PRECISION,
        help="vLLM KV-cache dtype(s): auto, fp8, fp8_e4m3, fp8_e5m2 (comma list).",
    ),
]

QuantizationOpt = Annotated[
    str,
    typer.Option(
        "--quantization",
        metavar="[none|fp8][,...]",
        rich_help_panel=PRECISION,
        help="vLLM weight quantization(s): none, fp8 (comma list; fp8 needs a GPU backend).",
    ),
]

LmHeadFp32Opt = Annotated[
    str,
    typer.Option(
        "--lm-head-fp32",
        metavar="[off|on|off,on]",
        rich_help_panel=PRECISION,
        help="Run vLLM's LM head in float32 (hf_overrides head_dtype): off, on, or off,on.",
    ),
]

RoutingReplayOpt = Annotated[
    str,
    typer.Option(
        "--routing-replay",
        metavar="[none|rollout|none,rollout]",
        rich_help_panel=PRECISION,
        help="MoE models: none (the trainer routes itself), rollout (R3: force the engine's "
        "routes in the training forward), or none,rollout to see what R3 removes.",
    ),
]

SameTokensOpt = Annotated[
    bool,
    typer.Option(
        "--same-tokens",
        metavar="",
        rich_help_panel=PRECISION,
        help="Score the first rollout setting's tokens in every engine (forced continuation, "
        "raw prefill log-probs), so settings differ only by numerics.",
    ),
]

StrictOpt = Annotated[
    bool,
    typer.Option(
        "--strict",
        metavar="",
        rich_help_panel=PRECISION,
        help="A setting the backend cannot run is an error (exit 2).",
    ),
]

ChatOpt = Annotated[
    bool | None,
    typer.Option(
        "--chat/--no-chat",
        metavar="",
        rich_help_panel=MODEL,
        help="Apply the tokenizer's chat template (default: on when the tokenizer has one).",
    ),
]

OutOpt = Annotated[
    Path | None,
    typer.Option(
        "--out",
        metavar="DIR",
        rich_help_panel=OUTPUT,
        help="Output directory (default: reports/<model>-<timestamp>/).",
    ),
]

ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force",
        metavar="",
        rich_help_panel=OUTPUT,
        help="Write into an --out directory that holds a run already, replacing its files.",
    ),
]

VllmArgOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--vllm-arg",
        metavar="KEY=VALUE",
        rich_help_panel=PRECISION,
        help="Extra vLLM engine argument key=value (value parsed as JSON when it can be), "
        "repeatable, e.g. --vllm-arg tensor_parallel_size=2 --vllm-arg max_num_seqs=8. Arguments "
        "probe sets from its own options (dtype, seed, ...) are refused: use those options.",
    ),
]

AttributeOpt = Annotated[
    bool,
    typer.Option(
        "--attribute",
        metavar="",
        rich_help_panel=ATTRIBUTION,
        help="Also score the same tokens at every rung (engine prefill batched and one at a "
        "time, transformers at the rollout dtype) and split the mismatch into links: "
        "attribution.json, a report section and plots/attribution.png. Scans in raw mode.",
    ),
]

StaleModelOpt = Annotated[
    Path | None,
    typer.Option(
        "--stale-model",
        metavar="PATH|ORG/NAME[@REV]",
        rich_help_panel=ATTRIBUTION,
        help="With --attribute: a second checkpoint (e.g. the next training step; a directory, "
        ".gguf or cached hub id like --model) rescoring the same tokens at the training dtype; "
        "adds the staleness link.",
    ),
]

LayersOpt = Annotated[
    bool,
    typer.Option(
        "--layers",
        metavar="",
        rich_help_panel=ATTRIBUTION,
        help="Also compare both sides' residual streams after every decoder layer (engine "
        "hooks during a prefill of the scanned ids against transformers' hidden states), "
        "each layer's attention and MLP outputs and the sampled tokens' logits: layers.json "
        "with each setting's first_divergent_layer. Needs eager mode.",
    ),
]

LayersSequencesOpt = Annotated[
    int | None,
    typer.Option(
        "--layers-sequences",
        metavar="K",
        rich_help_panel=ATTRIBUTION,
        help="With --layers: compare only the first K sequences of each setting (default: all).",
    ),
]

BatchTokensOpt = Annotated[
    int,
    typer.Option(
        "--batch-tokens",
        metavar="N",
        rich_help_panel=SCALE,
        help="Padded tokens per rescoring forward pass; also bounds how many positions' "
        "logits exist at once.",
    ),
]

FlipEpsOpt = Annotated[
    float | None,
    typer.Option(
        "--flip-eps",
        metavar="EPS",
        rich_help_panel=SAMPLING,
        help="Top-k/top-p boundary margin under which a token is flagged as a support flip "
        "(default by rollout dtype: fp32 1e-4, fp16 1e-3, bf16 8e-3).",
    ),
]

StepOpt = Annotated[
    str | None,
    typer.Option(
        "--step",
        metavar="N|last",
        rich_help_panel=SELECTION,
        help="Only one training step of an ingested run: a step number or 'last'.",
    ),
]

FormatArg = Annotated[
    str,
    typer.Argument(
        metavar="FORMAT",
        help="Log format: prime-rl, nemo-rl, slime, miles-parquet, verl-dp, skyrl (these two "
        "with --trust-pickle) or probe (our token schema); probe ingest also takes verl-log "
        "(verl's file-logger JSONL: a trend of the metrics verl logged, no tokens).",
    ),
]

SourceArg = Annotated[
    Path,
    typer.Argument(
        metavar="PATH",
        help="The framework's output: prime-rl output dir (or its token_exports/), NeMo-RL "
        "log dir, slime/Miles dump_details dir, a directory of verl step_<N>.dp dumps, SkyRL "
        "export_path (or its dumped_data/), or a ProbeWriter directory.",
    ),
]

IngestOutOpt = Annotated[
    Path,
    typer.Option(
        "--out",
        metavar="DIR",
        rich_help_panel=OUTPUT,
        help="Run directory to create (must not exist or be empty).",
    ),
]

IngestModelOpt = Annotated[
    Path | None,
    typer.Option(
        "--model",
        metavar="PATH|ORG/NAME[@REV]",
        rich_help_panel=MODEL,
        help="Checkpoint of the trained model (a directory, .gguf or cached hub id like scan's "
        "--model): rescores formats without a training side (miles-parquet) and adds each "
        "token's text to the reports.",
    ),
]

StepsOpt = Annotated[
    str | None,
    typer.Option(
        "--steps",
        metavar="N|A:B|A:|:B",
        rich_help_panel=SELECTION,
        help="Training steps to read, inclusive: N, A:B, A: or :B.",
    ),
]

TrustPickleOpt = Annotated[
    bool,
    typer.Option(
        "--trust-pickle",
        metavar="",
        rich_help_panel=SELECTION,
        help="Allow pickle-based dumps: verl-dp (.dp) and skyrl (.pkl), which are Python "
        "pickles, and slime .pt files holding more than tensors and lists. They are rebuilt "
        "from a whitelist of numpy/torch types (never importing verl, tensordict, SkyRL or "
        "slime, never running code the file names), but a whitelist is not a sandbox: only for "
        "files you trust.",
    ),
]

TrainDeviceMapOpt = Annotated[
    str | None,
    typer.Option(
        "--train-device-map",
        metavar="[auto|balanced|cuda|cpu]",
        rich_help_panel=SCALE,
        help="Where the training-side model runs: auto or balanced (split across GPUs, then "
        "CPU), cuda (one GPU) or cpu. Default: auto when several GPUs are visible or the model "
        "does not fit one GPU, else cuda (cpu without a GPU).",
    ),
]

ShardsOpt = Annotated[
    int,
    typer.Option(
        "--shards",
        metavar="N",
        rich_help_panel=SCALE,
        help="Split the prompts into N shards, each run (rollout + rescoring) on its own and "
        "written as its part of the store (tokens/shard=K/); with --ray, one Ray task each.",
    ),
]

RayOpt = Annotated[
    str | None,
    typer.Option(
        "--ray",
        metavar="ADDRESS",
        rich_help_panel=SCALE,
        help="Run the shards as Ray tasks: local (start a local Ray instance; also a bare --ray), "
        "auto (the cluster this machine belongs to) or a cluster address such as "
        "ray://head:10001.",
    ),
]

RayTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--ray-timeout",
        metavar="SECONDS",
        rich_help_panel=SCALE,
        help="Seconds to wait for a Ray cluster (--ray ADDRESS) to answer before giving up.",
    ),
]

ResumeOpt = Annotated[
    bool,
    typer.Option(
        "--resume",
        metavar="",
        rich_help_panel=SCALE,
        help="Sharded scan: skip the finished shards in --out and redo the others; options "
        "that differ from the recorded run are refused.",
    ),
]

VerboseOpt = Annotated[
    bool,
    typer.Option(
        "--verbose",
        metavar="",
        rich_help_panel=OUTPUT,
        help="Show the engine's logs (vLLM, Triton, torch) on the terminal; by default they go "
        "to a log file under the cache, named when an engine fails.",
    ),
]


ConvertAgainOpt = Annotated[
    bool,
    typer.Option(
        "--force", metavar="", rich_help_panel=OUTPUT, help="Convert again even if cached."
    ),
]

TinyOutArg = Annotated[
    Path, typer.Argument(metavar="OUT", help="Directory to write the checkpoint to.")
]

TinyArchOpt = Annotated[
    str,
    typer.Option(
        "--arch",
        metavar="[llama|qwen3_moe|mixtral]",
        rich_help_panel=MODEL,
        help="Architecture: llama (dense); qwen3_moe or mixtral (MoE: 8 experts, top-2).",
    ),
]

TinySeedOpt = Annotated[
    int,
    typer.Option(
        "--seed", metavar="SEED", rich_help_panel=MODEL, help="Seed of the random weights."
    ),
]

# --- the metric options block, shared by `probe metrics` and `probe report` ------------------

# (parameter name, option type, default from MetricsConfig's field): `metric_options` adds these
# to a command; the command receives them built and validated as one `metrics_config`.
METRIC_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("rollout_is", RolloutIsOpt),
    ("rollout_is_threshold", RolloutIsThresholdOpt),
    ("rollout_rs", RolloutRsOpt),
    ("rollout_rs_threshold", RolloutRsThresholdOpt),
    ("batch_normalize", BatchNormalizeOpt),
    ("preset", PresetOpt),
)


def metric_options(command: Callable[..., None]) -> Callable[..., None]:
    """Decorate a command that takes ``metrics_config: MetricsConfig``: its CLI signature gets
    the ``METRIC_OPTIONS`` instead (defaults from ``MetricsConfig``), and the values given are
    turned into that one config before the command runs."""
    from mismatch_probe.metrics.config import MetricsConfig

    defaults = {f.name: f.default for f in dataclasses.fields(MetricsConfig) if f.init}
    defaults["preset"] = None  # None: every preset (MetricsConfig's default)
    added = [
        inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, default=defaults[name], annotation=t
        )
        for name, t in METRIC_OPTIONS
    ]
    signature = inspect.signature(command, eval_str=True)  # typer reads these annotations
    kept = [p for p in signature.parameters.values() if p.name != "metrics_config"]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> None:
        values: dict[str, Any] = {name: kwargs.pop(name) for name, _ in METRIC_OPTIONS}
        preset = values.pop("preset")
        if preset is not None:
            values["presets"] = tuple(preset)
        command(**kwargs, metrics_config=MetricsConfig(**values))

    wrapper.__annotations__ = {p.name: p.annotation for p in [*kept, *added]}
    wrapper.__signature__ = signature.replace(parameters=[*kept, *added])  # type: ignore[attr-defined]
    return wrapper


# --- probe watch and probe export ------------------------------------------------------------

WatchModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        metavar="PATH|PATTERN",
        rich_help_panel=MODEL,
        help="Checkpoint to rescore with, as probe ingest --model, or a path pattern with "
        "{step} (e.g. 'ckpts/global_step_{step}/actor'), filled with the policy version that "
        "sampled the step's rollouts: the hook's audited rollouts are rescored with it.",
    ),
]

UntilOpt = Annotated[
    int | None,
    typer.Option(
        "--until",
        metavar="STEP",
        rich_help_panel=WATCH,
        help="Stop once this step (or a later one) is stored; without it, watch until Ctrl-C.",
    ),
]

OnAlertOpt = Annotated[
    str | None,
    typer.Option(
        "--on-alert",
        metavar="CMD",
        rich_help_panel=WATCH,
        help="Shell command run on each alert, the alert as one JSON object on its stdin "
        "(e.g. curl -d @- to a webhook).",
    ),
]

ExitOnAlertOpt = Annotated[
    bool,
    typer.Option(
        "--exit-on-alert",
        metavar="",
        rich_help_panel=WATCH,
        help="Stop at the first alert (a failed bound or an integrity error) and exit 1; RUN is "
        "finished first.",
    ),
]

IntervalOpt = Annotated[
    float,
    typer.Option(
        "--interval",
        metavar="SECONDS",
        rich_help_panel=WATCH,
        help="Seconds between two looks at DIR.",
    ),
]

SettleOpt = Annotated[
    float,
    typer.Option(
        "--settle",
        metavar="SECONDS",
        rich_help_panel=WATCH,
        help="Formats without a completion marker (one file per step): a step's file unchanged "
        "this long counts as complete when no later step follows it.",
    ),
]

AuditEveryOpt = Annotated[
    int | None,
    typer.Option(
        "--audit-every",
        metavar="N",
        rich_help_panel=WATCH,
        help="Read only every N-th step (step % N == 0) and keep a copy of its files in "
        "RUN/rollouts/ (for runs that skip the training-side recompute; see docs/watch.md).",
    ),
]

ExportToOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--export",
        metavar="[wandb|tensorboard|trackio|jsonl]",
        rich_help_panel=OUTPUT,
        help="Also write each step to this tracker as it is stored, repeatable (see probe export).",
    ),
]

ExportTargetOpt = Annotated[
    str,
    typer.Option(
        "--to",
        metavar="[wandb|tensorboard|trackio|jsonl]",
        rich_help_panel=OUTPUT,
        help="The tracker to write to.",
    ),
]

ExportOutOpt = Annotated[
    Path | None,
    typer.Option(
        "--export-out",
        metavar="PATH",
        rich_help_panel=OUTPUT,
        help="Where the tracker writes (tensorboard: a log dir, jsonl: a file, wandb/trackio: "
        "their local directory); default: under the run directory.",
    ),
]

ExportPathOpt = Annotated[
    Path | None,
    typer.Option(
        "--out",
        metavar="PATH",
        rich_help_panel=OUTPUT,
        help="Where the tracker writes (tensorboard: a log dir, jsonl: a file, wandb/trackio: "
        "their local directory); default: RUN/export/<tracker>.",
    ),
]

WandbRunOpt = Annotated[
    str | None,
    typer.Option(
        "--wandb-run",
        metavar="ID",
        rich_help_panel=OUTPUT,
        help="Resume this W&B run (the training run's id) so the probe/ curves sit beside its "
        "loss, on their own step axis.",
    ),
]

ProjectOpt = Annotated[
    str,
    typer.Option(
        "--project",
        metavar="NAME",
        rich_help_panel=OUTPUT,
        help="The W&B / trackio project.",
    ),
]


# --- probe refit ------------------------------------------------------------------------------

FromCkptOpt = Annotated[
    Path,
    typer.Option(
        "--from",
        metavar="DIR",
        rich_help_panel=MODEL,
        help="Checkpoint A (a transformers directory, safetensors): the engine starts on it.",
    ),
]

ToCkptOpt = Annotated[
    Path,
    typer.Option(
        "--to",
        metavar="DIR",
        rich_help_panel=MODEL,
        help="Checkpoint B: pushed into the running engine, and loaded fresh to compare.",
    ),
]

RefitMethodOpt = Annotated[
    str,
    typer.Option(
        "--method",
        metavar="[reload|load-weights|sleep-wake]",
        rich_help_panel=MODEL,
        help="How B reaches the running engine: reload (the worker's reload_weights from B's "
        "path), load-weights (model.load_weights on B's tensors, refused where the backend "
        "packs the weights or the engine runs in other processes), sleep-wake (sleep, reload, "
        "wake up).",
    ),
]

RefitPromptsOpt = Annotated[
    Path | None,
    typer.Option(
        "--prompts",
        metavar="FILE",
        rich_help_panel=MODEL,
        help="JSONL prompts file (as probe scan's). Default: the bundled prompts/refit.jsonl, "
        "whose prompts are longer than a 128-token prefix-cache block.",
    ),
]

RefitRolloutDtypeOpt = Annotated[
    str,
    typer.Option(
        "--rollout-dtype",
        metavar="DTYPE[,DTYPE...]",
        rich_help_panel=PRECISION,
        help="The engines' dtype(s): float32, float16, bfloat16; a comma list refits each as a "
        "setting (its own engines), as probe scan runs each.",
    ),
]

RefitTrainDtypeOpt = Annotated[
    str,
    typer.Option(
        "--train-dtype",
        metavar="DTYPE[,DTYPE...]",
        rich_help_panel=PRECISION,
        help="The transformers forward's dtype(s) on B (the engine_vs_train link); a comma list "
        "runs each.",
    ),
]

RefitKvCacheDtypeOpt = Annotated[
    str,
    typer.Option(
        "--kv-cache-dtype",
        metavar="DTYPE[,DTYPE...]",
        rich_help_panel=PRECISION,
        help="The engines' KV-cache dtype(s): auto, fp8, fp8_e4m3, fp8_e5m2 (comma list).",
    ),
]

RefitOutOpt = Annotated[
    Path,
    typer.Option("--out", metavar="DIR", rich_help_panel=OUTPUT, help="Output directory."),
]

MaxLinkOpt = Annotated[
    float,
    typer.Option(
        "--max-link",
        metavar="X",
        rich_help_panel=BOUNDS,
        help="A refit run (refit.json): fail when the refit or stale_prefix_cache link's k3_kl "
        "is above X (a correct refit gives exactly 0 in float32).",
    ),
]
