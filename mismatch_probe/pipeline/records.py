"""The records ``probe scan`` passes from stage to stage, and the one it returns.

``Prepared`` (inputs checked before any engine starts) -> ``RolloutRun`` (one rollout setting's
engine run) -> ``Rescored`` (one setting's sequences scored by the training model) ->
``ScanResult`` (what was written, and the loaded report). Plain data: no stage logic here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mismatch_probe.engine.rollout import Rollout
from mismatch_probe.pipeline.routes import Routing
from mismatch_probe.prompts import EncodedPrompt
from mismatch_probe.rundir.context import Entry, RunContext
from mismatch_probe.settings import RolloutSetting
from mismatch_probe.training.rescore import Scored


@dataclass
class Prepared:
    """Inputs checked and encoded before any engine starts."""

    model_dir: Path
    prompts_path: Path  # resolved
    chat: bool
    prompts: list[EncodedPrompt]
    max_model_len: int
    tokenizer: Any = field(repr=False)  # a transformers tokenizer
    routing: Routing | None = None  # a mixture-of-experts model's routing, else None
    batch_invariant: bool = False  # VLLM_BATCH_INVARIANT asked for (and supported here)
    train_devices: dict[str, Any] = field(default_factory=dict)  # train dtype -> device map
    # --attribute's extra models: "rollout_dtype=<dtype>" or "stale=<dtype>" -> device map
    attribution_devices: dict[str, Any] = field(default_factory=dict)
    out: Path | None = None  # the output directory, checked (None: a shard's worker)
    # engine arguments every range's engines take from the whole prompt file (the prefix cache
    # of a multi-turn file), so that every shard starts the same engine
    engine_defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def out_dir(self) -> Path:
        """The checked output directory (only a driver, never a shard's worker, asks)."""
        if self.out is None:
            raise AssertionError("prepare(cfg, out=False) checked no output directory")
        return self.out


@dataclass
class EngineRungs:
    """``--attribute``: per rollout, ``[R]`` engine prefill log-probabilities of its response
    tokens (the attribution spec's rungs L1 and L2)."""

    batched: list[list[float]]  # L1: every sequence in one batched prefill
    single: list[list[float]]  # L2: one sequence per engine step


@dataclass
class RolloutRun:
    """One rollout setting's engine run (or why it was skipped).

    ``engine_args`` and ``engine_env`` are recorded where the engine starts: exactly what
    ``vllm.LLM`` was created with (``run.json`` reports them).
    """

    setting: RolloutSetting
    rollouts: list[Rollout] = field(default_factory=list)
    generation_seconds: float = 0.0
    skipped: str | None = None
    routes: list[np.ndarray] | None = None  # MoE: per rollout [P + R - 1, L, K] expert ids
    engine_args: dict[str, Any] = field(default_factory=dict)
    engine_env: dict[str, str] = field(default_factory=dict)
    rungs: EngineRungs | None = None  # --attribute: the engine's prefill rungs
    engine_mode: str | None = None  # rollout.IN_PROCESS or MULTIPROCESS (None: not started)
    layers: Any = None  # --layers: the engine's captured streams (pipeline.layers.EngineLayers)

    @property
    def tokens_per_s(self) -> float:
        tokens = sum(len(r.response_ids) for r in self.rollouts)
        return tokens / self.generation_seconds if self.generation_seconds > 0 else 0.0


@dataclass
class Rescored:
    """One setting's sequences: rollouts, their rescoring, and (MoE) both sides' routes."""

    rollouts: list[Rollout]
    scored: list[Scored]
    rollout_routes: list[np.ndarray] | None = None  # per sequence [T, L, K] expert ids (engine)
    train_routes: list[np.ndarray] | None = None  # same shapes, training router's own choices
    seq_offset: int = 0  # added to each rollout's seq_id in the store (unique across settings)
    rungs: dict[str, np.ndarray | None] | None = None  # --attribute: rung column -> [N] float32


@dataclass
class ScanResult:
    """What a scan wrote and measured.

    Attributes:
        out_dir: the run directory.
        paths: output name -> path (``tokens``, ``run``, ``report``, ``plot_<name>``, ...).
        run: ``run.json``.
        settings: setting name -> flat metrics, in the scan's setting order (the first is the
            reference setting; the summary ranks them).
        skipped: rollout setting name -> why it did not run.
        report: the reference setting's loaded report.
        entries: one per setting of a precision-matrix run, in the settings' order
            (``rundir.order``; [] for one).
    """

    out_dir: Path
    paths: dict[str, Path]
    run: dict[str, Any]
    settings: dict[str, dict[str, float]]
    skipped: dict[str, str]
    report: RunContext
    entries: list[Entry]

    @property
    def metrics(self) -> dict[str, float]:
        """The first (reference) setting's metrics."""
        return next(iter(self.settings.values()))
