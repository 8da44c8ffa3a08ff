"""What ``probe --help`` shows besides the options: the commands in the order a user needs
them, ``--version``, and an "Examples" epilog per command.

The examples are real command lines of the docs (``tests/test_docs.py`` checks that each one is
a command line of a page and parses), so the help and the docs cannot drift apart. No heavy
import here: ``probe --help`` answers at once.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

import typer
from rich.markup import escape
from typer.core import TyperGroup

from mismatch_probe.options import PANELS

# The order of ``probe --help``'s command list: the main command first, the rest as a user meets
# them. A command missing here is listed after these, in the order it was added.
COMMAND_ORDER = (
    "scan", "report", "check", "compare", "metrics", "layers", "ingest", "watch", "export",
    "models", "refit", "selftest",
)  # fmt: skip

# Command path -> example command lines (each also a command line of a docs page).
EXAMPLES: dict[str, tuple[str, ...]] = {
    "scan": (
        "probe scan",
        "probe scan --rollout-dtype bfloat16,float16,float32 --kv-cache-dtype auto,fp8",
        "probe scan --model Qwen/Qwen3-0.6B --num-prompts 16 --max-tokens 64",
        "probe scan --model /tmp/tiny-moe --routing-replay none,rollout",
        "probe scan --attribute --rollout-dtype bfloat16 --train-dtype float32",
        "probe scan --ray auto --shards 32 --model /shared/models/Llama-3.1-70B-Instruct",
    ),
    "report": (
        "probe report reports/demo",
        "probe report reports/demo --format pr-comment",
    ),
    "check": (
        "probe check reports/demo --max k3_kl=1e-2 --max chi2_token=0.05 --min prob_pearson=0.99",
        "probe check runs/head --baseline runs/base --max-increase k3_kl=1.5x "
        "--max-increase f_tau_2=+0.001",
        "probe check reports/prime-run --max chi2_token=1 --step last",
        "probe check runs/batch-invariant --exact",
    ),
    "compare": (
        "probe compare reports/demo reports/demo-precision",
        "probe compare runs/base runs/head --out runs/compare --format pr-comment",
    ),
    "metrics": (
        "probe metrics reports/demo",
        "probe metrics reports/demo --json",
    ),
    "ingest": (
        "probe ingest prime-rl outputs/ --out reports/prime-run --steps 10:200",
        "probe ingest verl-dp dp_dumps --out reports/verl-run --trust-pickle",
    ),
    "watch": (
        "probe watch prime-rl outputs/ --out runs/live --max k3_kl=1e-3 --exit-on-alert",
        "probe watch probe /data/probe_logs --out runs/audit --model "
        "'ckpts/global_step_{step}/actor'",
    ),
    "export": (
        "probe export reports/prime-run --to tensorboard --out tb/prime",
        "probe export reports/prime-run --to wandb --wandb-run 1a2b3c4d",
    ),
    "refit": (
        "probe refit --from ckpts/step_100 --to ckpts/step_101 --out runs/refit",
        "probe refit --from ckpts/step_100 --to ckpts/step_101 --out runs/refit-sleep "
        "--method sleep-wake",
    ),
    "models prepare": ("probe models prepare",),
    "models tiny": ("probe models tiny /tmp/tiny-moe --arch qwen3_moe",),
    "selftest": ("probe selftest", "probe selftest --model /tmp/tiny --out runs/selftest"),
    "layers": ("probe layers reports/demo", "probe layers reports/demo --layers-sequences 8"),
}


def epilog(command: str) -> str:
    """The "Examples" epilog of ``probe COMMAND --help`` (rich markup)."""
    lines = "\n".join(escape(example) for example in EXAMPLES[command])
    return f"[bold]Examples[/bold]\n\n{lines}"


def version() -> str:
    """The installed distribution's version (the source tree's when it is not installed)."""
    try:
        return metadata.version("mismatch_probe")
    except metadata.PackageNotFoundError:
        from mismatch_probe import __version__

        return __version__


def print_version(value: bool) -> None:
    """``--version``: print ``probe VERSION`` and exit 0 (an eager option's callback)."""
    if value:
        print(f"probe {version()}")
        raise typer.Exit(0)


def show_help_without_command(ctx: typer.Context) -> None:
    """A bare ``probe`` (or ``probe models``) prints its help and exits 0, as ``--help`` does
    (click's ``no_args_is_help`` exits 2 with an empty error)."""
    if ctx.invoked_subcommand is None:
        text = ctx.get_help()  # rich help prints itself and returns ""
        if text:
            print(text)
        raise typer.Exit(0)


class ProbeGroup(TyperGroup):
    """Lists the commands in ``COMMAND_ORDER``, and shows no ``<bool>`` type for ``--help``."""

    def list_commands(self, ctx: Any) -> list[str]:
        names = super().list_commands(ctx)
        rank = {name: i for i, name in enumerate(COMMAND_ORDER)}
        return sorted(names, key=lambda name: rank.get(name, len(rank)))

    def get_help_option(self, ctx: Any) -> Any:
        return _no_metavar(super().get_help_option(ctx))


class ProbeCommand(typer.core.TyperCommand):
    """A command whose help shows its option panels in ``options.PANELS`` order (whatever the
    order of the function's parameters), and no ``<bool>``/``<path>`` type beside ``--help`` and
    the arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params.sort(key=_panel_rank)  # stable: arguments and each panel keep their order
        for param in self.params:
            if param.param_type_name == "argument":  # its metavar says it; no <path> beside it
                param.display_type_rich = lambda ctx: None  # type: ignore[attr-defined]

    def get_help_option(self, ctx: Any) -> Any:
        return _no_metavar(super().get_help_option(ctx))


def _panel_rank(param: Any) -> int:
    """Arguments first, then the options by panel (``options.PANELS``), unpanelled ones last."""
    panel = getattr(param, "rich_help_panel", None)
    if param.param_type_name == "argument":
        return -1
    return PANELS.index(panel) if panel in PANELS else len(PANELS)


def _no_metavar(option: Any) -> Any:
    if option is not None:
        option.metavar = ""
    return option
