"""The ``probe`` command line: a thin layer over the library.

Each command parses its options, builds one config object, calls one library function and
renders the result. A ``ProbeError`` anywhere becomes one line on stderr and exit code 2, in
``main`` alone. Heavy libraries (torch, vllm, transformers, matplotlib) are imported inside the
library functions, so ``probe --help`` answers at once.
"""

from __future__ import annotations

import sys

import typer

from mismatch_probe.errors import ProbeError

app = typer.Typer(
    help="Measure the training-inference mismatch of a language model.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
models_app = typer.Typer(help="Prepare and build models.", no_args_is_help=True)
app.add_typer(models_app, name="models")


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
    except SystemExit:
        raise
    except Exception as exc:  # click usage errors arrive as click.exceptions.UsageError
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            raise SystemExit(2) from None
        raise


if __name__ == "__main__":
    main()
