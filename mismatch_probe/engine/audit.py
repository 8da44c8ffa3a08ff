"""The weight audit of a refit: what the engine holds, against what it should hold.

Two comparisons of ``refit.effective_weights`` (engine names):

- ``compare_engines``: the refitted engine against the same engine loaded fresh on the new
  checkpoint (same names, no mapping): per tensor SHA-256, dtype, shape and max |diff|;
- ``compare_checkpoint``: the refitted engine against the checkpoint's own tensors placed by the
  engine's name mapping (``refit.Layout``): ``missing`` (an engine parameter no checkpoint
  tensor fills), ``unexpected`` (a checkpoint tensor the engine has no place for),
  ``mismatched`` (a checkpoint tensor whose place in the engine holds other values).

The negative control (``perturbed_copy``) is a copy of the checkpoint with one tensor changed:
refitted through the same path, the audit must name that tensor, or it reports itself broken.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mismatch_probe.engine.refit import Layout, iter_checkpoint, tensor_digest

if TYPE_CHECKING:
    import torch

# Engine parameters no checkpoint is expected to hold: the attention's quantization scales
# (vLLM defaults them to 1.0 where a checkpoint has none).
ENGINE_DEFAULTED = ("._k_scale", "._v_scale", "._q_scale", "._prob_scale")


@dataclass(frozen=True)
class TensorRow:
    """One engine tensor of the refitted engine against the fresh one."""

    name: str
    sha256: str
    dtype: str
    shape: tuple[int, ...]
    fresh_sha256: str | None  # None: the fresh engine has no such tensor
    max_abs_diff: float | None  # None: not comparable (missing, other shape or dtype)

    @property
    def equal(self) -> bool:
        return self.fresh_sha256 == self.sha256

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "sha256": self.sha256,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "fresh_sha256": self.fresh_sha256,
            "max_abs_diff": self.max_abs_diff,
            "equal": self.equal,
        }


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float | None:
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return None
    if a.numel() == 0:
        return 0.0
    diff = (a.to(torch.float64) - b.to(torch.float64)).abs().max()
    value = float(diff)
    return value if value == value and value != float("inf") else None


def compare_engines(
    refitted: Mapping[str, torch.Tensor], fresh: Mapping[str, torch.Tensor]
) -> tuple[list[TensorRow], list[str], list[str]]:
    """Every tensor of ``refitted`` against ``fresh``.

    Returns:
        The rows (by name), the names of tensors that differ (or the fresh engine lacks), and
        the names the fresh engine has that the refitted one lacks.
    """
    rows = []
    for name in sorted(refitted):
        tensor = refitted[name]
        other = fresh.get(name)
        rows.append(
            TensorRow(
                name,
                tensor_digest(tensor),
                str(tensor.dtype).removeprefix("torch."),
                tuple(tensor.shape),
                tensor_digest(other) if other is not None else None,
                _max_abs_diff(tensor, other) if other is not None else None,
            )
        )
    differ = [r.name for r in rows if not r.equal]
    absent = sorted(set(fresh) - set(refitted))
    return rows, differ, absent


@dataclass(frozen=True)
class CheckpointAudit:
    """The refitted engine against the checkpoint, by name."""

    checked: int  # checkpoint tensors compared at their place in the engine
    mismatched: list[str]  # checkpoint names whose place holds other values
    missing: list[str]  # engine parameters no checkpoint tensor fills
    unexpected: list[str]  # checkpoint names the engine has no place for
    not_compared: list[str]  # checkpoint expert names the engine's expert mapping did not place
    # mismatched expert tensors the engine stores with the checkpoint's values in the
    # checkpoint's layout, not prepacked, while its kernel reads them as prepacked
    not_repacked: list[str] = field(default_factory=list)


def compare_checkpoint(
    engine: Mapping[str, torch.Tensor],
    layout: Layout,
    checkpoint: Path,
    stored: Mapping[str, torch.Tensor] | None = None,
) -> CheckpointAudit:
    """Every tensor of ``checkpoint`` at the place the engine's name mapping gives it.

    ``stored``: the prepacked expert tensors as stored (``refit.stored_experts``), to tell
    which mismatched expert tensors hold the checkpoint's values unpacked."""
    import torch

    filled: set[str] = set()
    mismatched, unexpected, not_compared, not_repacked = [], [], [], []
    checked = 0
    for name, tensor in iter_checkpoint(checkpoint):
        place = layout.place(name)
        if place is None and layout.experts and ".experts." in name:
            not_compared.append(name)  # an expert tensor the expert mapping did not place
            continue
        if place is None or place.engine not in engine:
            unexpected.append(name)
            continue
        filled.add(place.engine)
        held = place.select(engine[place.engine])
        checked += 1
        expected = tensor.to(held.dtype)
        if held.shape != expected.shape or not torch.equal(held, expected):
            mismatched.append(name)
            raw = (stored or {}).get(place.engine)
            if raw is not None and torch.equal(place.select(raw), expected):
                not_repacked.append(name)
        head = engine.get(layout.head) if layout.head and place.engine == layout.tied else None
        if head is not None and not _same_rows(head, expected):
            mismatched.append(layout.head)  # the tied head computes with other values
    missing = sorted(
        n
        for n in layout.names
        if n not in filled
        and not n.endswith(ENGINE_DEFAULTED)
        and not (layout.experts and ".experts." in n and not_compared)
    )
    return CheckpointAudit(checked, sorted(mismatched), missing, sorted(unexpected),
                           not_compared, sorted(not_repacked))  # fmt: skip


def _same_rows(head: torch.Tensor, expected: torch.Tensor) -> bool:
    """A head padded to the engine's vocabulary: its first rows are the embedding's."""
    import torch

    rows = expected.shape[0]
    return head.shape[1:] == expected.shape[1:] and torch.equal(head[:rows], expected)


# --- the negative control ---------------------------------------------------------------------


def control_tensor(layout: Layout, checkpoint: Path) -> str:
    """The checkpoint tensor the negative control perturbs: the first (by name) placed into a
    fused engine tensor (the read-back and the slicing both exercised), else the first placed;
    an expert's tensor last (a wrong expert refit would name it without the audit working)."""
    placed = []
    for name, _ in _names(checkpoint):
        place = layout.place(name)
        if place is not None:
            placed.append((place.expert is not None, place.rows is None, name))
    if not placed:
        return ""
    return min(placed)[-1]


def _names(checkpoint: Path) -> Iterator[tuple[str, None]]:
    from safetensors import safe_open

    from mismatch_probe.engine.refit import checkpoint_files

    for file in checkpoint_files(checkpoint):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                yield name, None


def perturbed_copy(checkpoint: Path, name: str, out: Path) -> Path:
    """``out``: the checkpoint's files (linked), the one holding ``name`` rewritten with that
    tensor's first element changed by ``PERTURB_SCALE`` of itself (or of 1 where it is 0)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from mismatch_probe.engine.refit import PERTURB_SCALE, checkpoint_files

    out.mkdir(parents=True, exist_ok=True)
    holders = set()
    for file in checkpoint_files(checkpoint):
        with safe_open(str(file), framework="pt") as f:
            if name in f.keys():  # noqa: SIM118
                holders.add(file.name)
                tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
                metadata = f.metadata()
        if file.name in holders:
            flat = tensors[name].view(-1)
            step = PERTURB_SCALE * (abs(float(flat[0])) or 1.0)
            flat[0] = float(flat[0]) + step
            save_file(tensors, str(out / file.name), metadata=metadata)
    for entry in checkpoint.iterdir():
        if entry.name not in holders and not (out / entry.name).exists():
            os.symlink(entry.resolve(), out / entry.name)
    return out
