"""NeMo-RL GRPO training-data logs: ``<log_dir>/train_data_step<N>.jsonl``.

Checked against NVIDIA-NeMo/RL ``nemo_rl/algorithms/grpo.py`` (sync and async GRPO logging) and
``nemo_rl/utils/logger.py`` (``log_batched_dict_as_jsonl``) at commit 7ea279a (2026-08):

* one line per sample: ``content, rewards, input_lengths, token_ids, token_loss_mask,
  sample_loss_mask, advantages, generation_logprobs, prev_logprobs`` (optionally
  ``agent_ref``, ``filtered_rewards``) plus ``idx`` (the line's index) added by the logger;
* the logger slices the batch one sample at a time (``make_microbatch_iterator(1)``), so each
  field is a one-element list: ``token_ids`` is ``[[t0, t1, ...]]``. We accept that and a flat
  list alike;
* the arrays are the batch's padded ``input_ids``-aligned tensors: ``input_lengths`` gives the
  real length; ``generation_logprobs[i]`` / ``prev_logprobs[i]`` belong to ``token_ids[i]``,
  index 0 unused (grpo.py compares ``[:, 1:]``); prompt tokens have ``token_loss_mask`` 0;
* ``prev_logprobs`` is ``torch.zeros_like`` when the trainer skipped that forward
  (``force_on_policy_ratio``): not a training log-prob, so such a step is refused;
* ``json.dumps`` writes non-finite floats as ``NaN`` / ``Infinity``, which we read as NaN/inf;
* ``sample_loss_mask`` is the batch's ``sample_mask`` (the rollout's ``loss_multiplier``: 0 for
  a sample truncated past the length limit with overlong filtering, or filtered out): NeMo's loss
  (``ClippedPGLossFn``) multiplies it into the token mask, ``mask = token_mask[:, 1:] *
  sample_mask[:, None]``, and its ``gen_kl_error`` is the k3 estimator
  ``exp(prev - gen) - 1 - (prev - gen)`` averaged over that mask. We apply it the same way (a
  sample with 0 keeps no token), so our ``k3_kl`` of a step is NeMo's ``gen_kl_error``. Each
  record says so in ``mask_rules``; where the line has no ``sample_loss_mask``, or a weight
  other than 0 and 1 (which the token store cannot carry), the rule is recorded as not applied.

Off-policy: sync GRPO recomputes ``prev_logprobs`` with the weights that generated the
rollouts; async GRPO (``grpo.async_grpo``) trains on trajectories up to
``max_trajectory_age_steps`` old. The log does not say which ran.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from mismatch_probe.errors import ProbeError
from mismatch_probe.ingest.records import (
    MaskRule,
    SeqRecord,
    StepRange,
    as_bool_mask,
    check_lengths,
    field_of,
    float_array,
    int_array,
    iter_json_lines,
    masked_record,
    numbered_files,
    short_repr,
)

_STEP_FILE = re.compile(r"train_data_step(\d+)\.jsonl$")
SAMPLE_MASK = "sample_loss_mask"
_APPLIED = (
    "NeMo multiplies sample_loss_mask into the token mask: samples with 0 (truncated or "
    "filtered) are left out, as in NeMo's own gen_kl_error"
)
_MISSING = (
    "the log has no sample_loss_mask: samples NeMo leaves out of its loss and gen_kl_error "
    "(truncated or filtered) may be counted"
)
_WEIGHTED = (
    "sample_loss_mask holds weights other than 0 and 1, which the token store cannot carry: "
    "those samples are counted with weight 1"
)


def step_files(path: Path, steps: StepRange) -> list[tuple[int, Path]]:
    return numbered_files(path, _STEP_FILE, steps, "train_data_step<N>.jsonl file")


def _unwrap(value: Any) -> Any:
    """``[[...]]`` (one sample sliced from the batch) -> ``[...]``; ``[x]`` -> ``x`` for scalars."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
        return value[0]
    return value


def read(path: Path, steps: StepRange) -> Iterator[SeqRecord]:
    """Every sample of the chosen steps. Records are held back only while every one so far has
    all-zero ``prev_logprobs`` (normally just the first), so memory stays one line."""
    for step, file in step_files(path, steps):
        held: list[SeqRecord] = []
        trained = False
        for n, obj in iter_json_lines(file):
            record = _record(obj, step, f"{file}:{n}")
            if trained:
                yield record
                continue
            held.append(record)
            if len(record.token_ids) and not _zero(record.train):
                trained = True
                yield from held
                held.clear()
        if any(len(r.token_ids) for r in held):
            raise ProbeError(
                f"{file}: prev_logprobs are all zero (the trainer skipped its forward, "
                "force_on_policy_ratio): no training-side log-prob; exclude it with --steps"
            )
        yield from held  # only samples the sample mask removed: nothing to refuse


def _zero(train: np.ndarray | None) -> bool:
    return train is not None and bool(np.all(train == 0.0))


def _record(obj: dict[str, Any], step: int, where: str) -> SeqRecord:
    arrays = {
        "token_ids": _unwrap(field_of(obj, "token_ids", where)),
        "token_loss_mask": _unwrap(field_of(obj, "token_loss_mask", where)),
        "generation_logprobs": _unwrap(field_of(obj, "generation_logprobs", where)),
        "prev_logprobs": _unwrap(field_of(obj, "prev_logprobs", where)),
    }
    tokens = int_array(arrays["token_ids"], "token_ids", where)
    mask = float_array(arrays["token_loss_mask"], "token_loss_mask", where)
    rollout = float_array(arrays["generation_logprobs"], "generation_logprobs", where)
    train = float_array(arrays["prev_logprobs"], "prev_logprobs", where)
    n = check_lengths(
        where,
        token_ids=tokens,
        token_loss_mask=mask,
        generation_logprobs=rollout,
        prev_logprobs=train,
    )
    length = _input_length(obj, n, where)
    mask = as_bool_mask(mask, "token_loss_mask", where)
    mask[length:] = False
    mask[:1] = False  # index 0 has no log-prob
    rule, removed = _sample_mask(obj, int(mask.sum()), where)
    key = None if obj.get("idx") is None else f"idx {obj['idx']}"
    if removed:
        mask[:] = False
    return masked_record(step, where, key, tokens, mask, rollout, train, mask_rules=(rule,),
                         empty_ok=removed)  # fmt: skip


def _sample_mask(obj: dict[str, Any], tokens: int, where: str) -> tuple[MaskRule, bool]:
    """``sample_loss_mask`` as NeMo applies it (see the module docstring): the rule as this
    sample of ``tokens`` trained tokens met it, and whether it removes the sample."""
    value = _unwrap(obj.get(SAMPLE_MASK))
    value = value[0] if isinstance(value, list) and len(value) == 1 else value
    if value is None:
        return MaskRule(SAMPLE_MASK, False, _MISSING, tokens), False
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ProbeError(f"{where}: {SAMPLE_MASK} {short_repr(value)} is not a number")
    if value == 0:
        return MaskRule(SAMPLE_MASK, True, _APPLIED, tokens), True
    if value == 1:
        return MaskRule(SAMPLE_MASK, True, _APPLIED, 0), False
    if not 0 < value < 1:
        raise ProbeError(f"{where}: {SAMPLE_MASK} {short_repr(value)} is not within 0..1")
    return MaskRule(SAMPLE_MASK, False, _WEIGHTED, tokens), False


def _input_length(obj: dict[str, Any], n: int, where: str) -> int:
    value = obj.get("input_lengths")
    value = value[0] if isinstance(value, list) and len(value) == 1 else value
    if value is None:
        return n
    if not isinstance(value, int) or not 0 < value <= n:
        raise ProbeError(f"{where}: input_lengths {value!r} is not a length within 1..{n}")
    return value


def off_policy(path: Path) -> dict[str, Any]:
    return {
        "max_off_policy_steps": None,
        "source": "not in train_data_step*.jsonl: sync GRPO is on-policy, async GRPO trains on "
        "trajectories up to grpo.async_grpo.max_trajectory_age_steps old",
        "staleness": None,
    }
