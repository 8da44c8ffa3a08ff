"""``CheckConfig``: what ``probe check`` gates, built from the command line and validated once.

The config owns its rules: ``from_options`` parses every ``--max`` / ``--min`` /
``--max-increase`` and ``--accept`` and checks how the options combine (``--baseline`` needs
``--max-increase`` and the reverse, ``--step`` does not take a baseline, the confidence level
lies in (0, 1), ``--accept`` names a check, a one-sided key is bounded from its side); the gate
(``baseline.gate``) then only evaluates.
What needs the runs themselves (a metric or a setting the run lacks, runs that measure different
things) is checked when they are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mismatch_probe.errors import ProbeError
from mismatch_probe.gate.bounds import (
    Bound,
    Increase,
    check_sides,
    parse_bounds,
    parse_increase,
)
from mismatch_probe.metrics.integrity import CHECKS


@dataclass(frozen=True)
class CheckConfig:
    """Every option of ``probe check``, parsed.

    Attributes:
        run_dir: the run (HEAD) whose metrics are gated.
        bounds: ``--max`` then ``--min`` bounds (at least one unless there are increases).
        increases: ``--max-increase`` bounds against ``baseline``.
        baseline: the baseline run directory, or None.
        level: the bootstrap confidence level (``--significance``).
        allow_different: gate against a baseline that measures something else.
        step: one training step of an ingested run (``"last"`` or a number), or None.
        settings: the settings of a matrix run to gate (``--setting``); () means every one.
        accept: integrity checks whose error findings do not fail the gate (``--accept``).
        exact: fail unless ``parity/mismatch_count`` is 0 (``--exact``; a bound of its own).
    """

    run_dir: Path
    bounds: tuple[Bound, ...] = ()
    increases: tuple[Increase, ...] = ()
    baseline: Path | None = None
    level: float = 0.95
    allow_different: bool = False
    step: str | None = None
    settings: tuple[str, ...] = ()
    accept: tuple[str, ...] = ()
    exact: bool = False

    def __post_init__(self) -> None:
        for name in self.accept:
            if name not in CHECKS:
                raise ProbeError(f"--accept {name}: not an integrity check ({', '.join(CHECKS)})")
        if self.increases and self.baseline is None:
            raise ProbeError("--max-increase needs --baseline BASE_RUN_DIR")
        if self.baseline is not None and not self.increases:
            raise ProbeError("--baseline needs at least one --max-increase METRIC=1.5x or =+0.001")
        if not 0.0 < self.level < 1.0:
            raise ProbeError(
                f"--significance {self.level:g}: a confidence level in (0, 1), e.g. 0.95"
            )
        if not self.bounds and not self.increases and not self.exact:
            raise ProbeError(
                "no bound given: use --max METRIC=VALUE and/or --min METRIC=VALUE (or --exact)"
            )
        check_sides(self.bounds, self.increases)
        if self.step is not None and self.baseline is not None:
            raise ProbeError(
                "--step checks one training step's bounds; it does not take --baseline"
            )

    @classmethod
    def from_options(
        cls,
        run_dir: Path,
        maxima: list[str] | None = None,
        minima: list[str] | None = None,
        baseline: Path | None = None,
        increases: list[str] | None = None,
        level: float = 0.95,
        allow_different: bool = False,
        step: str | None = None,
        settings: list[str] | None = None,
        accept: list[str] | tuple[str, ...] | None = None,
        exact: bool = False,
    ) -> CheckConfig:
        """The config of the command line's options (raw ``METRIC=VALUE`` strings)."""
        parsed = tuple(parse_increase(s) for s in increases or [])
        bounds = parse_bounds(list(maxima or []), list(minima or [])) if maxima or minima else ()
        return cls(
            run_dir=Path(run_dir),
            bounds=bounds,
            increases=parsed,
            baseline=None if baseline is None else Path(baseline),
            level=level,
            allow_different=allow_different,
            step=step,
            settings=tuple(dict.fromkeys(settings or [])),
            accept=tuple(dict.fromkeys(accept or [])),
            exact=exact,
        )
