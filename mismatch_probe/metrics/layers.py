"""Per-layer agreement of two sides' residual streams (``probe scan --layers``).

For every token and decoder layer, the RMS-relative difference ``||a - b|| / ||b||`` (``b`` the
reference side: the training model) and the cosine similarity of the two streams. A
``LayerSums`` holds per-layer float64 sums, maxima and the worst tokens only: streams are added
chunk by chunk (``add``) and dropped, so memory never grows with the run. ``curve`` turns the
sums into the numbers ``layers.json`` holds; ``first_divergent_layer`` and ``largest_growth``
read a curve against the float32 floor.

The last decoder layer is compared after the model's final norm (transformers' last hidden state
is taken after it; the engine's final norm output is captured to match).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# A floor never below float32 rounding (a measured floor of exact zeros would make any
# difference a divergence).
FLOAT32_EPS = float(np.finfo(np.float32).eps)
# The floor when no fp32/fp32 comparison ran: float32 rounding through a few operations
# (measured: 5e-7 to 7e-7 on the tiny test models, CPU engine against transformers).
NOMINAL_FLOOR = 1e-6
DIVERGENCE_FACTOR = 10.0  # a layer diverges at 10x the floor (issue 36)
WORST = 5  # worst tokens kept per layer
# The parts of a decoder layer compared beside its stream, where every layer of both sides has
# them, by the module names vLLM's and transformers' decoder layers share: the attention output
# (after its output projection) and the MLP (or MoE block) output, each before the residual add.
PARTS: dict[str, tuple[str, ...]] = {
    "attention": ("self_attn",),
    "mlp": ("mlp", "block_sparse_moe"),
}


def part_modules(layer: Any) -> dict[str, Any]:
    """The ``PARTS`` modules a decoder layer has (by the first of its names it holds)."""
    found = {}
    for part, names in PARTS.items():
        module = next((getattr(layer, n) for n in names if hasattr(layer, n)), None)
        if module is not None:
            found[part] = module
    return found


@dataclass
class LayerSums:
    """Running per-layer sums over the tokens added so far.

    Attributes:
        layers: decoder layers compared (the last one after the final norm).
        tokens: tokens added.
        rel_sum, rel_max, cos_sum: ``[L]`` float64.
        worst: per layer, a min-heap of ``(relative difference, sequence, position)``.
    """

    layers: int
    tokens: int = 0
    sequences: int = 0
    rel_sum: np.ndarray = field(init=False)
    rel_max: np.ndarray = field(init=False)
    cos_sum: np.ndarray = field(init=False)
    worst: list[list[tuple[float, int, int]]] = field(init=False)

    def __post_init__(self) -> None:
        self.rel_sum = np.zeros(self.layers, np.float64)
        self.rel_max = np.zeros(self.layers, np.float64)
        self.cos_sum = np.zeros(self.layers, np.float64)
        self.worst = [[] for _ in range(self.layers)]

    def add(self, other: np.ndarray, reference: np.ndarray, sequence: int) -> None:
        """One sequence's ``[T, L, H]`` streams: ``other`` against ``reference``.

        Raises:
            ValueError: the shapes differ, or the layer count is not ``layers``.
        """
        if other.shape != reference.shape or other.shape[1] != self.layers:
            raise ValueError(f"streams {other.shape} and {reference.shape}, {self.layers} layers")
        a, b = other.astype(np.float64), reference.astype(np.float64)
        diff = np.linalg.norm(a - b, axis=-1)
        norm_a, norm_b = np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)
        rel = diff / np.maximum(norm_b, np.finfo(np.float64).tiny)  # [T, L]
        cos = (a * b).sum(-1) / np.maximum(norm_a * norm_b, np.finfo(np.float64).tiny)
        self.rel_sum += rel.sum(0)
        self.rel_max = np.maximum(self.rel_max, rel.max(0, initial=0.0))
        self.cos_sum += cos.sum(0)
        for layer in range(self.layers):
            column = rel[:, layer]
            top = np.argsort(column)[-WORST:]
            for pos in top:
                item = (float(column[pos]), sequence, int(pos))
                heap = self.worst[layer]
                (heapq.heappush if len(heap) < WORST else heapq.heappushpop)(heap, item)
        self.tokens += rel.shape[0]
        self.sequences += 1

    def mean_rel(self) -> np.ndarray:
        return self.rel_sum / max(self.tokens, 1)


@dataclass
class LogitSums:
    """Running sums of the sampled tokens' logits, one side against the other (float64): the
    RMS-relative difference ``sqrt(sum (a - b)^2 / sum b^2)`` over every token, the mean and
    max absolute difference, the worst tokens."""

    tokens: int = 0
    sq_diff: float = 0.0
    sq_ref: float = 0.0
    abs_sum: float = 0.0
    abs_max: float = 0.0
    dot: float = 0.0
    sq_other: float = 0.0
    worst: list[tuple[float, int, int]] = field(default_factory=list)

    def add(self, other: np.ndarray, reference: np.ndarray, sequence: int, start: int) -> None:
        """One sequence's ``[T - 1]`` next-token logits, from position ``start`` on (the
        positions whose next token was sampled: the response)."""
        a = other.astype(np.float64)[start:]
        b = reference.astype(np.float64)[start:]
        if a.shape != b.shape:
            raise ValueError(f"logits {other.shape} and {reference.shape}")
        diff = np.abs(a - b)
        self.tokens += diff.size
        self.sq_diff += float((diff**2).sum())
        self.sq_ref += float((b**2).sum())
        self.sq_other += float((a**2).sum())
        self.dot += float((a * b).sum())
        self.abs_sum += float(diff.sum())
        self.abs_max = max(self.abs_max, float(diff.max(initial=0.0)))
        for pos in np.argsort(diff)[-WORST:]:
            item = (float(diff[pos]), sequence, int(pos) + start + 1)  # the sampled token's
            (heapq.heappush if len(self.worst) < WORST else heapq.heappushpop)(self.worst, item)

    def rel(self) -> float:
        return float(np.sqrt(self.sq_diff / max(self.sq_ref, float(np.finfo(np.float64).tiny))))


@dataclass
class LayerComparison:
    """One comparison of two sides, layer by layer: the stream's sums, each part's both sides
    captured (``PARTS``) and the sampled tokens' logits (None when a side has none)."""

    stream: LayerSums
    parts: dict[str, LayerSums] = field(default_factory=dict)
    logits: LogitSums | None = None

    @classmethod
    def of(cls, other: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> LayerComparison:
        """Empty sums shaped by one sequence's captures (``stream``, parts, ``logit``)."""
        layers = reference["stream"].shape[1]
        parts = {p: LayerSums(layers) for p in PARTS if p in other and p in reference}
        logits = LogitSums() if "logit" in other and "logit" in reference else None
        return cls(LayerSums(layers), parts, logits)

    def add(
        self,
        other: dict[str, np.ndarray],
        reference: dict[str, np.ndarray],
        sequence: int,
        start: int = 0,
    ) -> None:
        """One sequence's captures (``start``: its first position whose next token was
        sampled, for the logits)."""
        self.stream.add(other["stream"], reference["stream"], sequence)
        for part, sums in self.parts.items():
            sums.add(other[part], reference[part], sequence)
        if self.logits is not None:
            self.logits.add(other["logit"], reference["logit"], sequence, start)


def floor_of(reference: LayerSums | None) -> tuple[np.ndarray | None, str]:
    """The per-layer floor: the mean relative difference of an fp32/fp32 comparison (never
    below float32 epsilon), and where it came from; ``(None, "nominal")`` without one."""
    if reference is None or reference.tokens == 0:
        return None, "nominal"
    return np.maximum(reference.mean_rel(), FLOAT32_EPS), "measured"


def first_divergent_layer(mean_rel: np.ndarray, floor: np.ndarray | None) -> int | None:
    """The first layer (0-based) whose mean relative difference exceeds ``DIVERGENCE_FACTOR``
    times the floor at that layer (``NOMINAL_FLOOR`` everywhere when ``floor`` is None);
    None when none does."""
    bound = DIVERGENCE_FACTOR * (np.full_like(mean_rel, NOMINAL_FLOOR) if floor is None else floor)
    above = np.flatnonzero(mean_rel > bound)
    return int(above[0]) if above.size else None


def largest_growth(mean_rel: np.ndarray) -> int | None:
    """The layer (>= 1) whose mean relative difference grew most over the layer before it
    (the largest ratio); None with fewer than two layers or no difference at all."""
    if mean_rel.size < 2 or not np.any(mean_rel > 0):
        return None
    prev = np.maximum(mean_rel[:-1], FLOAT32_EPS)
    return int(np.argmax(mean_rel[1:] / prev)) + 1


def curve(
    sums: LayerSums, floor: np.ndarray | None, floor_source: str, final_norm: bool = True
) -> dict[str, Any]:
    """What ``layers.json`` holds of one comparison: per layer its mean and max relative
    difference, mean cosine and worst tokens; the floor; ``first_divergent_layer`` and
    ``largest_growth_layer`` (``final_norm``: the last layer is taken after the final norm, as
    the stream; a part's is not)."""
    mean = sums.mean_rel()
    rows = []
    for layer in range(sums.layers):
        worst = sorted(sums.worst[layer], reverse=True)
        rows.append(
            {
                "layer": layer,
                "after_final_norm": final_norm and layer == sums.layers - 1,
                "mean_rel": float(mean[layer]),
                "max_rel": float(sums.rel_max[layer]),
                "mean_cosine": float(sums.cos_sum[layer] / max(sums.tokens, 1)),
                "worst_tokens": [
                    {"sequence": s, "position": p, "rel": float(v)} for v, s, p in worst
                ],
            }
        )
    used = np.full(sums.layers, NOMINAL_FLOOR) if floor is None else floor
    return {
        "sequences": sums.sequences,
        "tokens": sums.tokens,
        "layers": rows,
        "floor": [float(x) for x in used],
        "floor_source": floor_source,
        "first_divergent_layer": first_divergent_layer(mean, floor),
        "largest_growth_layer": largest_growth(mean),
    }


def logit_floor(reference: LogitSums | None) -> tuple[float, str]:
    """The floor of the sampled tokens' logits: the identity comparison's RMS-relative
    difference (never below float32 epsilon), else ``NOMINAL_FLOOR``."""
    if reference is None or reference.tokens == 0:
        return NOMINAL_FLOOR, "nominal"
    return max(reference.rel(), FLOAT32_EPS), "measured"


def logit_point(sums: LogitSums, floor: float) -> dict[str, Any]:
    """The last point of the curve: the sampled tokens' logits (``layers.json``'s
    ``logits``): their RMS-relative difference and cosine over every sampled token, the mean
    and max absolute difference, the worst tokens; ``divergent`` above 10x ``floor``."""
    norm = np.sqrt(max(sums.sq_other, 0.0) * max(sums.sq_ref, 0.0))
    rel = sums.rel()
    return {
        "tokens": sums.tokens,
        "rel": rel,
        "cosine": float(sums.dot / norm) if norm > 0 else 1.0,
        "mean_abs": sums.abs_sum / max(sums.tokens, 1),
        "max_abs": sums.abs_max,
        "floor": floor,
        "divergent": bool(rel > DIVERGENCE_FACTOR * floor),
        "worst_tokens": [
            {"sequence": s, "position": p, "abs": float(v)} for v, s, p in sorted(sums.worst)[::-1]
        ],
    }


def routing_flips(
    engine_routes: list[np.ndarray], train_routes: list[np.ndarray], layers: int
) -> list[int]:
    """MoE: per layer, the tokens (of the sequences given) that the two sides route to a
    different set of experts (``[T, L, K]`` expert ids per sequence, each side's own routes)."""
    flips = np.zeros(layers, np.int64)
    for a, b in zip(engine_routes, train_routes, strict=True):
        n = min(len(a), len(b))
        if n == 0:
            continue
        differ = np.any(np.sort(a[:n], axis=-1) != np.sort(b[:n], axis=-1), axis=-1)  # [T, L]
        flips[: differ.shape[1]] += differ.sum(0)[:layers]
    return [int(x) for x in flips]


def mark_routing(entry: dict[str, Any], flips: list[int]) -> None:
    """Mark the layers of ``entry`` (a ``curve``) where a token was routed differently:
    ``routing_flips`` per layer row, ``routing_flip_layers`` the layers with any."""
    for row, count in zip(entry["layers"], flips, strict=False):
        row["routing_flips"] = count
    entry["routing_flip_layers"] = [i for i, count in enumerate(flips) if count > 0]
