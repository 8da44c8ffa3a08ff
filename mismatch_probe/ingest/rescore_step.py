"""``probe watch --model``: the training side of a step from a checkpoint, as ``probe ingest
--model`` does it (``ingest.rescoring``), the checkpoint chosen per step.

``--model`` is a checkpoint, or a path pattern with ``{step}`` (``ckpts/global_step_{step}/actor``)
filled with the policy version that sampled the rollouts: the hook's recorded version for an
audited step (``audit.audit_records``), the step number otherwise. The model of one path is
kept loaded until another is needed. For the hook's format, a step with audited rollouts is
measured by rescoring them (the run skipped its own recompute, or the audit checks it); a step
without is read as written. A format without a training side (Miles) is rescored every step; any
other format takes ``--model`` for token text only, as ``probe ingest`` does.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mismatch_probe.errors import ProbeError
from mismatch_probe.ingest.formats import Format
from mismatch_probe.ingest.records import IngestConfig, SeqRecord

STEP_FIELD = "{step}"


class Rescorer:
    """Models by policy version for one watch (see the module docstring)."""

    def __init__(self, cfg: IngestConfig) -> None:
        from mismatch_probe import models

        self.cfg = cfg
        self.pattern = str(cfg.model)
        self.loaded: tuple[Path, Any] | None = None
        self.token_dir: Path | None = None
        self.tokenizer: Any = None
        if STEP_FIELD not in self.pattern:  # one checkpoint: its tokenizer gives token text
            from mismatch_probe.ingest.run import _tokenizer

            self.token_dir = models.resolve_model(Path(self.pattern))
            self.tokenizer = _tokenizer(self.token_dir)

    def path_for(self, version: int) -> Path:
        path = Path(self.pattern.replace(STEP_FIELD, str(version)))
        if not path.exists():
            raise ProbeError(f"no checkpoint for policy version {version}: {path} does not exist")
        return path

    def model_for(self, version: int) -> Any:
        from mismatch_probe import models
        from mismatch_probe.training import rescore

        path = self.path_for(version)
        if self.loaded is None or self.loaded[0] != path:
            self.loaded = None  # the previous model is freed first
            model = rescore.load_model(models.resolve_model(path), self.cfg.train_dtype)
            self.loaded = (path, model)
        return self.loaded[1]

    def rescore(self, records: Iterator[SeqRecord], model: Any) -> Iterator[SeqRecord]:
        from mismatch_probe.ingest.rescoring import rescored
        from mismatch_probe.sampling import SamplingSpec

        spec = SamplingSpec(temperature=self.cfg.temperature)
        return rescored(records, model, spec, self.cfg.train_dtype, self.cfg.batch_tokens)

    def records(self, fmt: Format, one: IngestConfig, root: Path | None, step: int
                ) -> list[SeqRecord]:  # fmt: skip
        """The step's records, rescored where the module docstring says."""
        if one.format == "probe" and root is not None:
            from mismatch_probe.ingest.audit import audit_records, rescore_by_version

            rows = audit_records(root / f"step_{step}", step)
            if rows is not None:
                return rescore_by_version(rows, self.model_for, self.rescore)
            return list(fmt.read(one))
        if fmt.needs_model:
            return list(self.rescore(fmt.read(one), self.model_for(step)))
        return list(fmt.read(one))
