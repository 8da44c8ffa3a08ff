"""The fault table of ``probe selftest``: one ``Fault`` per row, each a known defect injected
into a copy of a clean scan's tokens and the detector that must catch it.

A row names how the fault is injected (``inject``: the clean ``Tokens`` in, the faulty ones
out), the path its data takes in real use (``path``: ``"store"``, the scan's token store;
``"ingest"``, written as a framework log and read by ``probe ingest``; ``"exact"``, a store whose
two sides were made bitwise equal first; ``"matrix"``, a precision-matrix store with the fault
in one setting; ``"refit"``, the scanned model pushed into an engine running it through
``probe refit``'s reload with one tensor perturbed, its tokens untouched) and what must see it
(``expect``: an integrity check, ``"check"`` for ``probe check``'s k3 bound, ``"exact"`` for
``probe check --exact``, ``"matrix"`` for ``probe check`` naming the faulty setting, ``"refit
audit"``). Adding a row is adding an entry to ``FAULTS``.

Rows whose detector another branch adds are in the table already; ``requires`` names the
integrity check such a row needs, and while this probe lacks it the row reports so and does
not hold (it cannot have been seen to fire).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import pairwise

import numpy as np

PLACEHOLDER_SPAN = 8  # tokens of one "tool span" given a rollout log-prob of 0.0
PARTIAL_SHARE = 0.3  # the share of sequences shifted in the partial row
IMPLAUSIBLE = -1e9  # the placeholder of implausible_logprob


@dataclass(frozen=True)
class Tokens:
    """The tokens of one setting, row-aligned ``[N]`` arrays, rows of a sequence contiguous in
    position order. ``valid`` False marks a row taken out (padding, null on both sides).
    ``rescored``: the training side's log-probs of the same tokens under other settings
    (``"T=0.7"``, ``"T=1.3"``, ``"top_p=0.9"``: the nucleus renormalized, ``-inf`` outside)."""

    seq: np.ndarray
    train: np.ndarray  # float32
    rollout: np.ndarray  # float32
    valid: np.ndarray
    rescored: dict[str, np.ndarray]

    def with_sides(self, train: np.ndarray | None = None, rollout: np.ndarray | None = None,
                   valid: np.ndarray | None = None) -> Tokens:  # fmt: skip
        return replace(
            self,
            train=self.train if train is None else train.astype(np.float32),
            rollout=self.rollout if rollout is None else rollout.astype(np.float32),
            valid=self.valid if valid is None else valid,
        )

    def starts(self) -> np.ndarray:
        """First row of each sequence (and the end)."""
        cut = np.flatnonzero(np.diff(self.seq)) + 1
        return np.concatenate([[0], cut, [len(self.seq)]])


@dataclass(frozen=True)
class Fault:
    """One row of the table (see the module docstring)."""

    name: str
    injected: str
    expect: str
    inject: Callable[[Tokens], Tokens]
    path: str = "store"
    requires: str = ""  # the integrity check this row needs ("" : none beyond ``expect``)


def shift(t: Tokens, share: float = 1.0) -> Tokens:
    """The training log-probs left-shifted by one position (``train[t] = train[t+1]``, the last
    token keeps its own) on the first ``share`` of the sequences (ms-swift#8196)."""
    train = t.train.copy()
    starts = t.starts()
    count = max(1, round(share * (len(starts) - 1)))
    for a, b in pairwise(starts[: count + 1]):
        train[a : b - 1] = t.train[a + 1 : b]
    return t.with_sides(train=train)


def placeholder(t: Tokens) -> Tokens:
    """A tool-span-like run of ``PLACEHOLDER_SPAN`` tokens in every other sequence given a
    rollout log-prob of exactly 0.0 (SkyRL#354)."""
    rollout = t.rollout.copy()
    starts = t.starts()
    for a, b in zip(starts[:-1:2], starts[1::2], strict=True):
        mid = a + max(0, (b - a - PLACEHOLDER_SPAN) // 2)
        rollout[mid : min(b, mid + PLACEHOLDER_SPAN)] = 0.0
    return t.with_sides(rollout=rollout)


def copy_rollout(t: Tokens) -> Tokens:
    """The trainer side copied from the rollout side (verl's bypass mode)."""
    return t.with_sides(train=t.rollout.copy())


def implausible(t: Tokens) -> Tokens:
    """``-1e9`` placeholders on the rollout side of five tokens of the first sequence."""
    rollout = t.rollout.copy()
    rollout[: min(5, t.starts()[1])] = IMPLAUSIBLE
    return t.with_sides(rollout=rollout)


def rescored(key: str, side: str) -> Callable[[Tokens], Tokens]:
    """One side replaced by the training side's scores under ``key`` (tokens outside a nucleus,
    ``-inf`` there, taken out on both sides: an engine that truncates never samples them)."""

    def inject(t: Tokens) -> Tokens:
        scores = t.rescored[key]
        keep = t.valid & np.isfinite(scores)
        return t.with_sides(**{side: np.where(keep, scores, 0.0)}, valid=keep)

    return inject


def fp16_rollout(t: Tokens) -> Tokens:
    """The rollout side rounded to float16 (the store's two sides are bitwise equal before)."""
    return t.with_sides(rollout=t.train.astype(np.float16).astype(np.float32))


def permute(t: Tokens) -> Tokens:
    """The training sides of whole sequences rotated among the sequences of the most common
    length: every sequence gets another one's log-probs."""
    starts = t.starts()
    lengths = np.diff(starts)
    common = np.bincount(lengths).argmax()
    same = np.flatnonzero(lengths == common)
    train = t.train.copy()
    for src, dst in zip(same, np.roll(same, 1), strict=True):
        train[starts[dst] : starts[dst + 1]] = t.train[starts[src] : starts[src + 1]]
    return t.with_sides(train=train)


def past_bound(t: Tokens) -> Tokens:
    """The setting's rollout side off by a fixed noise (|r| about 0.3) in one setting."""
    rng = np.random.default_rng(0)
    return t.with_sides(rollout=np.minimum(t.rollout + rng.normal(0.0, 0.3, len(t.train)), 0.0))


CONTROL = Fault("clean control", "nothing: the scan's own tokens", "none", lambda t: t)
FAULTS: tuple[Fault, ...] = (
    CONTROL,
    Fault("shifted by one, all", "training log-probs shifted one position, every sequence",
          "shifted_by_one", shift),
    Fault("shifted by one, a share", f"the same on {PARTIAL_SHARE:.0%} of the sequences",
          "shifted_by_one", lambda t: shift(t, PARTIAL_SHARE)),
    Fault("placeholder 0.0", f"rollout 0.0 on a {PLACEHOLDER_SPAN}-token span, every other "
          "sequence", "placeholder_logprob", placeholder),
    Fault("trainer copies rollout", "training side = rollout side, as a framework log",
          "trainer_copies_rollout", copy_rollout, path="ingest"),
    Fault("-1e9 placeholders", "rollout side -1e9 on five tokens", "implausible_logprob",
          implausible, requires="implausible_logprob"),
    Fault("temperature gap, T=0.7", "the same tokens rescored by the training side at T=0.7",
          "temperature_mismatch", rescored("T=0.7", "train")),
    Fault("temperature gap, T=1.3", "the same tokens rescored by the training side at T=1.3",
          "temperature_mismatch", rescored("T=1.3", "train")),
    Fault("top-p renormalization", "rollout side renormalized over the training side's "
          "top-p 0.9 nucleus", "truncated_support", rescored("top_p=0.9", "rollout")),
    Fault("rounded to fp16", "rollout log-probs rounded to fp16, on a bitwise-equal store",
          "exact", fp16_rollout, path="exact"),
    Fault("rows permuted", "whole sequences' training sides swapped", "check", permute),
    Fault("one setting past a bound", "a matrix, one setting's rollout side off by noise",
          "matrix", past_bound, path="matrix"),
    Fault("one tensor perturbed in a refit", "the model pushed into an engine running it "
          "(probe refit --method reload), one weight tensor perturbed", "refit audit",
          lambda t: t, path="refit"),
)  # fmt: skip
