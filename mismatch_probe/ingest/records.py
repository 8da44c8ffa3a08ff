"""The common record every format reader yields, the ingest config, and the shared checks.

A reader turns one framework's files into ``SeqRecord`` s, one response at a time, steps in
increasing order, never holding more than one step file (a JSONL line, a ``.pt`` dump, a Parquet
row group) in memory. Every record holds only the *response* tokens the framework trains on
(its loss mask), each with its position in the response (0 = the first trained token):

* ``rollout[i]``: the inference engine's log-prob of ``token_ids[i]``;
* ``train[i]``: the trainer's recomputed log-prob of the same token (``None`` for the whole
  record when the format has no training side: the ingest rescores it with ``--model``).

Non-finite log-probs (a framework's ``null`` / ``NaN``) stay NaN here and are stored as nulls,
which the metric engine reads as padding (not counted).

A format-specific mask rule (NeMo-RL's ``sample_loss_mask``) is applied by the reader; each
record says which rules it met in ``mask_rules`` (``MaskRule``), and the run's ``run.json``
sums them (``mask_rules``), applied or not, so a report can say when one could not be applied.

Sign convention downstream: ``r = train - rollout``.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mismatch_probe.errors import ProbeError
from mismatch_probe.option_rules import check_choices, check_options
from mismatch_probe.settings import DTYPES


@dataclass(frozen=True)
class MaskRule:
    """A format-specific mask rule as one record met it.

    Attributes:
        rule: the framework's name of the mask, e.g. ``"sample_loss_mask"``.
        applied: whether the reader applied it (as the framework does in its own metrics).
        detail: what applying it means, or why it could not be applied (one sentence, the same
            for every record in the same case, so that ``run.json`` can sum them).
        tokens: the record's tokens it removed (applied) or would have changed (not applied).
    """

    rule: str
    applied: bool
    detail: str
    tokens: int = 0


@dataclass
class SeqRecord:
    """One response of one training step.

    Attributes:
        step: the framework's training step (rollout id for slime/Miles).
        source: where it came from, for people: ``"step_3/rank_0.jsonl:12"``.
        prompt_key: the framework's group key (responses to one prompt share it), or None.
        token_ids: ``[R]`` int64 trained response tokens.
        positions: ``[R]`` int64 position of each in the response.
        rollout: ``[R]`` float64 engine log-probs (NaN where the framework logged none).
        train: ``[R]`` float64 trainer log-probs, or None when the format has none.
        prompt_ids: the prompt's token ids (only kept when the format needs rescoring).
        response_ids: the whole response, trained or not (likewise), which ``positions``
            index.
        mask_rules: the format-specific mask rules this record met (see ``MaskRule``).
        turn: ``[R]`` int64 explicit turn ids where the format has them; None: the writer
            numbers the runs of consecutive positions (``turns_from_positions``).
    """

    step: int
    source: str
    prompt_key: str | None
    token_ids: np.ndarray
    positions: np.ndarray
    rollout: np.ndarray
    train: np.ndarray | None
    prompt_ids: np.ndarray | None = None
    response_ids: np.ndarray | None = None
    mask_rules: tuple[MaskRule, ...] = ()
    turn: np.ndarray | None = None


def turns_from_positions(positions: np.ndarray) -> np.ndarray:
    """``[R]`` 0-based turn of each trained token: a multi-turn response's trained tokens come in
    runs of consecutive positions (its mask, verl's ``response_mask``, slime's and SkyRL's
    ``loss_mask``, is 0 over tool output and other observations), each run one turn."""
    if len(positions) == 0:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([[0], np.cumsum(np.diff(positions) > 1)]).astype(np.int64)


@dataclass(frozen=True)
class StepRange:
    """Inclusive step bounds of ``--steps A:B`` (None = open)."""

    first: int | None = None
    last: int | None = None

    def __contains__(self, step: object) -> bool:
        if not isinstance(step, int):
            return False
        return (self.first is None or step >= self.first) and (
            self.last is None or step <= self.last
        )

    @property
    def explicit(self) -> bool:
        return self.first is not None or self.last is not None


def parse_steps(text: str | None) -> StepRange:
    """``"10:200"`` (both inclusive), ``"10:"``, ``":200"``, ``"7"`` or None (every step)."""
    if text is None or not text.strip():
        return StepRange()
    first, sep, last = text.strip().partition(":")
    try:
        lo = int(first) if first.strip() else None
        hi = (int(last) if last.strip() else None) if sep else lo
    except ValueError:
        raise ProbeError(f"--steps {text!r}: expected N, A:B, A: or :B (integers)") from None
    if lo is not None and hi is not None and lo > hi:
        raise ProbeError(f"--steps {text!r}: the first step is after the last")
    return StepRange(lo, hi)


@dataclass(frozen=True)
class IngestConfig:
    """One ``probe ingest``.

    Args:
        format: a name of ``ingest.formats.FORMATS``.
        path: the framework's output (directory or file, per format).
        out: the run directory to create; must not exist or be empty.
        model: checkpoint for rescoring (Miles) and token text; None for neither.
        steps: which steps to read.
        trust_pickle: allow pickle-based dumps (verl-dp, skyrl) and slime's
            ``torch.load(weights_only=False)`` (unpickling runs code from the file).
        temperature: the rollout's sampling temperature (for rescoring only).
        train_dtype: the rescoring dtype.
        batch_tokens: padded tokens per rescoring forward pass.
    """

    format: str
    path: Path
    out: Path
    model: Path | None = None
    steps: StepRange = field(default_factory=StepRange)
    trust_pickle: bool = False
    temperature: float = 1.0
    train_dtype: str = "float32"
    batch_tokens: int = 2048

    def __post_init__(self) -> None:
        """The options' rules, the same functions as the scan's (``option_rules.check_options``),
        checked before anything is read."""
        check_options({"--temperature": self.temperature, "--batch-tokens": self.batch_tokens})
        check_choices((self.train_dtype,), DTYPES, "--train-dtype")


def numbered_files(
    path: Path, pattern: re.Pattern[str], steps: StepRange, what: str, subdir: str | None = None
) -> list[tuple[int, Path]]:
    """``(step, file)`` for the files of ``path`` (of ``path/subdir`` where that folder exists)
    whose name matches ``pattern`` (group 1: the step number) and whose step is in ``steps``,
    steps ascending.

    Raises:
        ProbeError: ``path`` is not a folder, two files carry the same step number, or no file
            of ``what`` is in the chosen steps.
    """
    require_dir(path, f"the {what}s")
    root = path / subdir if subdir and (path / subdir).is_dir() else path
    found = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := pattern.match(p.name)))
    chosen = unique_steps([(n, p) for n, p in found if n in steps])
    if not chosen:
        raise ProbeError(f"{root}: no {what} in the chosen steps")
    return chosen


def require_dir(path: Path, what: str) -> None:
    """``path`` is a directory; else one line: a file where a directory is expected, or none."""
    if path.is_dir():
        return
    if path.exists():
        raise ProbeError(f"{path} is a file; give the directory that holds {what}")
    raise ProbeError(f"{path}: no such directory")


def unique_steps(found: list[tuple[int, Path]]) -> list[tuple[int, Path]]:
    """``found`` (``(step, path)``, steps ascending) when no step number appears twice
    (``step_2`` and ``step_02``); else one line naming both, as neither can be chosen."""
    for (a, first), (b, second) in itertools.pairwise(found):
        if a == b:
            raise ProbeError(f"step {a} appears twice: {first} and {second}; remove or rename one")
    return found


def iter_json_lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` of each non-empty line; a bad line names file and line."""
    try:
        with path.open("r", encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as exc:
                    raise ProbeError(f"{path}:{number}: not valid JSON ({exc.args[0]})") from None
                if not isinstance(obj, dict):
                    raise ProbeError(f"{path}:{number}: expected a JSON object per line")
                yield number, obj
    except UnicodeDecodeError:
        raise ProbeError(f"{path}: not UTF-8 text") from None
    except OSError as exc:
        raise ProbeError(f"{path}: cannot read ({exc.strerror})") from None


def field_of(obj: dict[str, Any], key: str, where: str) -> Any:
    if key not in obj or obj[key] is None:
        raise ProbeError(f"{where}: missing field {key!r}")
    return obj[key]


def float_array(values: Any, name: str, where: str) -> np.ndarray:
    """A float64 array of a list of numbers (``null`` -> NaN; ``inf`` stays for the engine)."""
    try:
        return np.array(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise ProbeError(f"{where}: {name} is not a list of numbers") from None


def int_array(values: Any, name: str, where: str) -> np.ndarray:
    try:
        out = np.array(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise ProbeError(f"{where}: {name} is not a list of integers") from None
    if not np.all(np.isfinite(out)) or np.any(out != np.round(out)):
        raise ProbeError(f"{where}: {name} is not a list of integers")
    if np.any(np.abs(out) >= 2.0**63):
        raise ProbeError(f"{where}: {name} holds an integer outside int64")
    return out.astype(np.int64)


def int_value(value: Any, name: str, where: str) -> int:
    """One integer (a Python, numpy or 0-d tensor integer, or a float with no fraction); anything
    else (a list, a string, a bool, NaN) is one line naming ``where`` and ``name``."""
    if hasattr(value, "tolist") and not isinstance(value, (list, str)):
        value = value.tolist()  # numpy scalar or 0-d tensor; an array becomes a list
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProbeError(f"{where}: {name} {short_repr(value)} is not an integer")
    return value


def group_key(value: Any, name: str, where: str) -> str | None:
    """A framework's group key (responses to one prompt share it): a string or an integer,
    as a string; None or an empty string when there is none; anything else is one line."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise ProbeError(f"{where}: {name} {short_repr(value)} is not a string or an integer")


def short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_lengths(where: str, **arrays: np.ndarray | None) -> int:
    """The common length of ``arrays`` (None ones skipped); unequal lengths name each."""
    sizes = {name: len(a) for name, a in arrays.items() if a is not None}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{name} {n}" for name, n in sizes.items())
        raise ProbeError(f"{where}: arrays of unequal length ({listed})")
    return next(iter(sizes.values()), 0)


def check_shapes(file: Path, **arrays: np.ndarray) -> None:
    """All ``[B, R]`` arrays of one batch dump agree; unequal shapes name each."""
    shapes = {name: a.shape for name, a in arrays.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name} {list(shape)}" for name, shape in shapes.items())
        raise ProbeError(f"{file}: arrays of unequal shape ({listed})")


def masked_record(
    step: int,
    where: str,
    prompt_key: str | None,
    token_ids: np.ndarray,
    mask: np.ndarray,
    rollout: np.ndarray,
    train: np.ndarray | None,
    first: int | None = None,
    mask_rules: tuple[MaskRule, ...] = (),
    empty_ok: bool = False,
) -> SeqRecord:
    """Keep the tokens of ``mask``; positions count from ``first`` (default: the first masked
    token). All arrays are full length and aligned (checked by the caller). A mask selecting
    no token is an error unless ``empty_ok`` (a sample a mask rule removed)."""
    keep = np.flatnonzero(mask)
    if len(keep) == 0 and not empty_ok:
        raise ProbeError(f"{where}: the loss mask selects no token")
    start = (int(keep[0]) if len(keep) else 0) if first is None else first
    return SeqRecord(
        step=step,
        source=where,
        prompt_key=prompt_key,
        token_ids=token_ids[keep],
        positions=keep - start,
        rollout=rollout[keep],
        train=None if train is None else train[keep],
        mask_rules=mask_rules,
    )


def as_bool_mask(values: np.ndarray, name: str, where: str) -> np.ndarray:
    """0/1 or false/true values -> bool; anything else is an error."""
    if values.size and not np.all(np.isin(values, (0.0, 1.0))):
        raise ProbeError(f"{where}: {name} holds values other than 0/1")
    return values.astype(bool)
