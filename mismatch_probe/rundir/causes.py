"""Why a worst token mismatches, from what the run knows about it (the ``cause`` column).

For each of the worst tokens (``context.WorstToken``), in this order, every cause that applies:

* ``support flip``: the token sat at the top-k/top-p boundary (the store's ``support_flip``);
* ``MoE routing differs``: the rollout and training sides chose different experts for it in at
  least one layer (``routing.parquet`` of an MoE scan);
* the attribution's dominant link for this token (``--attribute``: the link of largest ``|r|``
  among those whose two rungs it has, ``metrics.attribution.LINKS``), e.g. ``engine vs
  transformers kernels (attribution)``;
* ``low-probability tail``: its probability is below ``TAIL`` on either side (where most of the
  mismatch lives, metrics spec section 4).

None applies: ``—`` (no cause is claimed without evidence). Only the worst tokens' rows are read.
Sign convention: ``r = train_logprob - rollout_logprob``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mismatch_probe import store
from mismatch_probe.errors import ProbeError

TAIL = 0.1  # a probability below this on either side is the low-probability tail
FLIP, ROUTING, TAIL_TEXT, NONE = (
    "support flip",
    "MoE routing differs",
    "low-probability tail",
    "—",
)
LEGEND = (
    f"Cause: {FLIP} (the top-k/top-p boundary moved), {ROUTING} (different experts in some "
    "layer), the attribution's largest link for the token (with --attribute), "
    f"{TAIL_TEXT} (p < {TAIL:g} on either side); {NONE} when none applies."
)
Key = tuple[int, int]  # (seq_id, position)


def describe(flip: bool | None, rollout_lp: float, train_lp: float, known: Sequence[str]) -> str:
    """The cause text of one token (``known``: routing and attribution causes found)."""
    parts = [FLIP] if flip else []
    parts += list(known)
    if min(rollout_lp, train_lp) < math.log(TAIL):  # log space: a log-prob of 710 cannot overflow
        parts.append(TAIL_TEXT)
    return ", ".join(parts) if parts else NONE


def known_causes(run_dir: Path, setting: str | None, keys: Sequence[Key]) -> dict[Key, list[str]]:
    """Routing and attribution causes of the tokens ``keys`` (``{}`` when the run has neither)."""
    out: dict[Key, list[str]] = {k: [] for k in keys}
    if not keys:
        return out
    for key in _routing_differs(run_dir, setting, keys):
        out[key].append(ROUTING)
    for key, link in _dominant_links(run_dir, setting, keys).items():
        out[key].append(f"{link} (attribution)")
    return out


def _routing_differs(run_dir: Path, setting: str | None, keys: Sequence[Key]) -> set[Key]:
    from mismatch_probe.routing.metrics import differing
    from mismatch_probe.routing.store import read_routing, resolve_routing_path

    if not run_dir.is_dir() or not resolve_routing_path(run_dir).exists():
        return set()
    try:
        routes = read_routing(run_dir, setting)
    except ProbeError:
        return set()  # an unreadable routing file: the routing section says so
    wanted = set(keys)
    rows = [
        i
        for i, key in enumerate(zip(routes.seq_id.tolist(), routes.position.tolist(), strict=True))
        if key in wanted
    ]
    if not rows:
        return set()
    sel = np.asarray(rows)
    differs = np.asarray(differing(routes.rollout[sel], routes.train[sel]).any(axis=-1))
    return {
        (int(routes.seq_id[i]), int(routes.position[i]))
        for i, d in zip(sel, differs, strict=True)
        if d
    }


def _dominant_links(run_dir: Path, setting: str | None, keys: Sequence[Key]) -> dict[Key, str]:
    """Each token's link of largest ``|r_link|`` among those with both rungs (two or more)."""
    from mismatch_probe.metrics.attribution import L4, LINKS, NO_REPLAY, RUNG_COLUMNS, TRAIN

    path = store.resolve_tokens_path(run_dir)
    names = store.open_parquet(path, required=()).schema_arrow.names
    rungs = [c for c in RUNG_COLUMNS if c in names]
    if not rungs:
        return {}
    columns = ["seq_id", "position", "rollout_logprob", "train_logprob", *rungs]
    columns += ["setting"] if "setting" in names and setting is not None else []
    ids = sorted({k[0] for k in keys})
    table = pq.read_table(path, columns=columns, filters=[("seq_id", "in", ids)])
    if setting is not None and "setting" in table.column_names:
        table = table.filter(pc.equal(table.column("setting"), setting))
    data = {c: table.column(c).to_numpy(zero_copy_only=False) for c in columns if c != "setting"}
    values = {c: np.asarray(pc.fill_null(table.column(c), np.nan), dtype=np.float64) for c in rungs}
    values["rollout_logprob"] = np.asarray(data["rollout_logprob"], dtype=np.float64)
    values[TRAIN] = np.asarray(data["train_logprob"], dtype=np.float64)
    values[L4] = np.where(np.isnan(values.get(NO_REPLAY, np.full(len(table), np.nan))),
                          values[TRAIN], values.get(NO_REPLAY, values[TRAIN]))  # fmt: skip
    wanted = set(keys)
    out = {}
    for i, key in enumerate(zip(data["seq_id"].tolist(), data["position"].tolist(), strict=True)):
        if key not in wanted:
            continue
        sizes = {
            link.words: abs(values[link.upper][i] - values[link.lower][i])
            for link in LINKS
            if link.name != "staleness" and link.upper in values and link.lower in values
        }
        sizes = {w: s for w, s in sizes.items() if not math.isnan(s)}
        if len(sizes) >= 2 and max(sizes.values()) > 0:
            out[(int(key[0]), int(key[1]))] = max(sizes, key=lambda w: sizes[w])
    return out
