"""Multi-turn trajectories on the pipeline's side: one rescoring request each, the store's turn
columns, and the re-render drift of the chat template (the multi-turn spec).

The engine side (``engine.turns``) grows each trajectory ``P0 + G1 + D1 + G2 + ...`` turn by turn.
Here a trajectory becomes one ``ScoreRequest`` (one forward pass over all of it; scored: the
generated tokens only), and its sequence row gets ``num_turns``, each turn's finish reason and
the re-render drift: the final conversation (generated turns as decoded text) rendered by the
chat template and tokenized, as a trainer that re-applies the template would, compared with the
trajectory's ids.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from mismatch_probe.engine.rollout import Rollout
from mismatch_probe.errors import ProbeError
from mismatch_probe.prompts import EncodedPrompt, render_chat
from mismatch_probe.training.rescore import ScoreRequest

CONTEXT_BEFORE, CONTEXT_AFTER = 6, 4  # tokens shown around the first re-render difference


def check(prompts: Sequence[EncodedPrompt], routing: Any) -> None:
    """Refuse what multi-turn prompts cannot run with (before any engine starts).

    Raises:
        ProbeError: multi-turn prompts on a mixture-of-experts model whose routes come from the
            engine's decode (``native_decode``: each turn's request returns only its own
            routes); prefill-replay capture replays the whole trajectory (``token_view``).
    """
    from mismatch_probe.engine.routing import NATIVE

    multi = any(p.turns is not None for p in prompts)
    if multi and routing is not None and routing.setup.capture_path == NATIVE:
        raise ProbeError(
            "multi-turn prompts on a mixture-of-experts model need prefill-replay route "
            "capture (the engine's decode returns each turn's routes alone)"
        )


class TokenView(NamedTuple):
    """A sequence's ids as route capture and replay see them (``routing.shape.TokenSequence``)."""

    prompt_ids: list[int]
    response_ids: list[int]


def token_view(r: Rollout) -> Any:
    """The rollout itself, or for a multi-turn trajectory ``P0`` and everything after it: routes
    then cover the whole trajectory, and the store's positions (continuation indices) pick the
    generated tokens' rows."""
    return r if r.turns is None else TokenView(list(r.prompt_ids), list(r.turns.continuation))


def score_request(r: Rollout) -> ScoreRequest:
    """The rescoring request of a rollout: a multi-turn trajectory whole (its context ids too),
    scored at its generated tokens only."""
    if r.turns is None:
        return ScoreRequest(r.prompt_ids, r.response_ids)
    return ScoreRequest(r.prompt_ids, list(r.turns.continuation), list(r.turns.positions))


def token_positions(r: Rollout) -> list[int]:
    """``[R]`` the store's ``position`` of each response token (index after the prompt)."""
    return r.scored_positions()


def token_turns(r: Rollout) -> list[int]:
    """``[R]`` the store's ``turn`` of each response token (0 for a single-turn response)."""
    return list(r.turns.turn) if r.turns is not None else [0] * len(r.response_ids)


@dataclass(frozen=True)
class Rerender:
    """Re-render drift of one trajectory.

    Attributes:
        differs: the re-rendered ids differ from the trajectory's somewhere within its length.
        mismatched: generated tokens whose id differs or has no aligned counterpart.
        context: the first difference in context (None when there is none).
    """

    differs: bool
    mismatched: int
    context: str | None


def final_messages(r: Rollout, messages: Sequence[dict[str, Any]], tokenizer: Any) -> list[Any]:
    """The conversation as a trainer would keep it: each open turn filled with its generated
    text (decoded without special tokens), given messages after the last one dropped."""
    assert r.turns is not None
    texts = [
        tokenizer.decode(_turn_ids(r, k), skip_special_tokens=True)
        for k in range(len(r.turns.starts))
    ]
    out, k = [], 0
    for m in messages:
        if k == len(texts):
            break
        if m.get("role") == "assistant" and m.get("content") is None:
            out.append({**m, "content": texts[k]})
            k += 1
        else:
            out.append(dict(m))
    return out


def _turn_ids(r: Rollout, k: int) -> list[int]:
    assert r.turns is not None
    return [t for t, turn in zip(r.response_ids, r.turns.turn, strict=True) if turn == k]


def rerender(r: Rollout, messages: Sequence[dict[str, Any]], tokenizer: Any) -> Rerender:
    """Re-render drift of a multi-turn trajectory (see the module docstring).

    The trajectory ``T = P0 + continuation`` is aligned with the re-rendered ids ``R``
    (longest matching blocks); a generated token counts as mismatched unless it lies in a
    block. ``differs`` compares ``T`` with ``R``'s first ``len(T)`` ids (the template's close of
    the last turn may follow in ``R``).
    """
    assert r.turns is not None
    text = render_chat(tokenizer, final_messages(r, messages, tokenizer), False, r.prompt_id)
    again = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    ids = [*r.prompt_ids, *r.turns.continuation]
    matcher = difflib.SequenceMatcher(None, ids, again, autojunk=False)
    aligned = bytearray(len(ids))
    for block in matcher.get_matching_blocks():
        aligned[block.a : block.a + block.size] = b"\x01" * block.size
    base = len(r.prompt_ids)
    mismatched = sum(1 for p in r.turns.positions if not aligned[base + p])
    first = next((i for i, (a, b) in enumerate(zip(ids, again, strict=False)) if a != b), None)
    if first is None and len(again) < len(ids):
        first = len(again)
    context = None if first is None else _context(r, ids, again, first, tokenizer)
    return Rerender(first is not None, mismatched, context)


def _context(r: Rollout, ids: list[int], again: list[int], at: int, tokenizer: Any) -> str:
    """``turn 1, token 37 of the trajectory: engine …[a][b]|c|… / re-rendered …[a][b]|x|…``."""
    assert r.turns is not None
    offset = at - len(r.prompt_ids)
    turn = sum(1 for s in r.turns.starts if s <= offset) - 1 if offset >= 0 else -1
    where = "the prompt" if turn < 0 else f"turn {turn}"

    def show(seq: list[int]) -> str:
        pieces = [tokenizer.decode([t]) for t in seq[max(at - CONTEXT_BEFORE, 0) : at]]
        head = "".join(f"[{p}]" for p in pieces)
        tail = seq[at : at + CONTEXT_AFTER]
        nxt = "".join(f"[{tokenizer.decode([t])}]" for t in tail[1:])
        mark = f"»{tokenizer.decode([tail[0]])}«" if tail else "»(end)«"
        return f"…{head}{mark}{nxt}…"

    return f"{where}, trajectory token {at}: engine {show(ids)} / re-rendered {show(again)}"


def sequence_columns(rollouts: Sequence[Rollout], tokenizer: Any) -> dict[str, list[Any]]:
    """The sequences store's multi-turn columns (``store.SEQUENCE_TURN_FIELDS``) of
    ``rollouts``; the re-render drift only for multi-turn trajectories (null elsewhere)."""
    cols: dict[str, list[Any]] = {
        "num_turns": [],
        "turn_finish_reasons": [],
        "rerender_differs": [],
        "rerender_mismatched_tokens": [],
        "rerender_context": [],
    }
    for r in rollouts:
        t = r.turns
        cols["num_turns"].append(len(t.starts) if t else 1)
        cols["turn_finish_reasons"].append(",".join(t.finish_reasons) if t else r.finish_reason)
        drift = rerender(r, t.messages, tokenizer) if t is not None and t.messages else None
        cols["rerender_differs"].append(drift.differs if drift else None)
        cols["rerender_mismatched_tokens"].append(drift.mismatched if drift else None)
        cols["rerender_context"].append(drift.context if drift else None)
    return cols
