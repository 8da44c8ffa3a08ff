"""Prompt sets: JSONL files, one object a line, with ``prompt`` (text) or ``messages`` (chat).

``load_prompts`` validates the file and reports the first bad line by number. ``encode_prompts``
turns prompts into token ids with the model's tokenizer (applying its chat template when asked),
so that both the engine and the rescorer see exactly the same ids.

Multi-turn prompts (the multi-turn spec): an assistant message without ``content`` (or with
``"content": null``) is a turn the engine generates. Such a prompt is encoded into a
``TurnPlan``: ``P0`` (the messages before the first open turn, with the generation prompt) and,
for each boundary between two open turns, the ids the chat template renders after an assistant
turn (its close, the given messages, the next generation prompt). The engine side
(``engine.turns``) appends them to its sampled ids without ever re-tokenizing those.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mismatch_probe.errors import ProbeError

DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "prompts" / "default.jsonl"


@dataclass(frozen=True)
class Prompt:
    """One line of a prompts file: plain text or a chat conversation."""

    prompt_id: int  # 0-based line index among the non-empty lines
    text: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None

    @property
    def open_turns(self) -> int:
        """Assistant messages the engine generates (0: a single-turn prompt)."""
        return sum(map(_is_open, self.messages or ()))


@dataclass(frozen=True)
class TurnPlan:
    """How a multi-turn prompt's trajectory grows between its generated turns.

    ``ids = P0 + G1 + D1 + G2 + ... + Gn`` with ``P0`` the prompt's ``token_ids``; after turn
    ``k`` (``k < n - 1``) the engine appends ``after_end[k]`` when the turn ended with
    ``end_id`` (the token the template's assistant close begins with), else ``after_cut[k]``
    (the whole close: a turn cut at ``--max-tokens`` is closed as the template closes an
    assistant message). Both hold the given messages and the next generation prompt.
    """

    turns: int  # generated turns (n)
    end_id: int | None
    after_end: tuple[tuple[int, ...], ...]  # [n - 1] context ids
    after_cut: tuple[tuple[int, ...], ...]  # [n - 1] context ids
    messages: tuple[dict[str, Any], ...] = ()  # the prompt's messages (open turns: no content)

    def context_after(self, turn: int, generated: Sequence[int]) -> tuple[int, ...]:
        """The context ids appended after generated turn ``turn`` (empty after the last)."""
        if turn >= self.turns - 1:
            return ()
        ended = bool(generated) and self.end_id is not None and generated[-1] == self.end_id
        return self.after_end[turn] if ended else self.after_cut[turn]

    def longest_context(self) -> int:
        """The most context ids the boundaries can add."""
        return sum(max(len(e), len(c)) for e, c in zip(self.after_end, self.after_cut, strict=True))


@dataclass(frozen=True)
class EncodedPrompt:
    prompt_id: int
    text: str  # what the model sees (after the chat template)
    token_ids: tuple[int, ...]
    turns: TurnPlan | None = None  # a multi-turn prompt's plan (None: single turn)

    def longest_trajectory(self, max_tokens: int) -> int:
        """The most tokens its trajectory can hold (every turn at ``max_tokens``)."""
        if self.turns is None:
            return len(self.token_ids) + max_tokens
        return len(self.token_ids) + self.turns.longest_context() + self.turns.turns * max_tokens


def default_prompts_path() -> Path:
    """The bundled prompt set (in the source tree; shipped next to the package)."""
    if DEFAULT_PROMPTS.is_file():
        return DEFAULT_PROMPTS
    raise ProbeError(f"the bundled prompt set is missing ({DEFAULT_PROMPTS}); pass --prompts")


def load_prompts(path: Path, limit: int | None = None) -> list[Prompt]:
    """Read and validate a JSONL prompts file.

    Raises:
        ProbeError: missing or empty file, or a line that is not an object with a non-empty
            ``prompt`` string or a ``messages`` list of ``{"role", "content"}`` strings.
    """
    if not path.is_file():
        raise ProbeError(f"prompts file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ProbeError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    prompts: list[Prompt] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        prompts.append(_parse_line(line, lineno, len(prompts), path))
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise ProbeError(f"prompts file is empty: {path}")
    return prompts


def select_prompts(prompts: list[Prompt], ids: tuple[int, ...], path: Path) -> list[Prompt]:
    """The prompts whose ``prompt_id`` is in ``ids``, in file order (duplicates once).

    Raises:
        ProbeError: an id the file does not have.
    """
    missing = sorted(set(ids) - {p.prompt_id for p in prompts})
    if missing:
        raise ProbeError(
            f"--prompt-id {missing[0]}: {path} has {len(prompts)} prompts "
            f"(ids 0..{len(prompts) - 1})"
        )
    wanted = set(ids)
    return [p for p in prompts if p.prompt_id in wanted]


def _has_lone_surrogate(obj: Any) -> bool:
    """Whether a string anywhere in ``obj`` holds a lone surrogate (``"\\ud800"`` in JSON)."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(obj, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in obj.items())
    if isinstance(obj, list):
        return any(_has_lone_surrogate(v) for v in obj)
    return False


def _parse_line(line: str, lineno: int, prompt_id: int, path: Path) -> Prompt:
    where = f"{path}:{lineno}"
    try:
        obj: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ProbeError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ProbeError(f"{where}: expected a JSON object with 'prompt' or 'messages'")
    if _has_lone_surrogate(obj):
        raise ProbeError(
            f"{where}: a lone UTF-16 surrogate (such as \\ud800) in the text is not valid "
            "Unicode; no tokenizer can encode it"
        )
    if isinstance(obj.get("prompt"), str) and obj["prompt"].strip():
        return Prompt(prompt_id, text=obj["prompt"])
    messages = obj.get("messages")
    if isinstance(messages, list) and messages and all(map(_is_message, messages)):
        return Prompt(prompt_id, messages=tuple(dict(m) for m in messages))
    raise ProbeError(
        f"{where}: needs a non-empty 'prompt' string or a 'messages' list of "
        "{'role': str, 'content': str} objects (an assistant message without content is a "
        "turn the engine generates)"
    )


def _is_message(m: Any) -> bool:
    return (
        isinstance(m, dict)
        and isinstance(m.get("role"), str)
        and (isinstance(m.get("content"), str) or _is_open(m))
    )


def _is_open(m: dict[str, Any]) -> bool:
    """An assistant message without content: a turn the engine generates."""
    return m.get("role") == "assistant" and m.get("content") is None


def encode_prompts(
    prompts: list[Prompt], tokenizer: Any, chat: bool, max_context: int, max_tokens: int
) -> list[EncodedPrompt]:
    """Render and tokenize prompts; fail if a prompt plus ``max_tokens`` exceeds the context.

    With ``chat`` the tokenizer's chat template is applied (a plain ``prompt`` becomes one user
    message); without it, ``messages`` are joined by newlines as plain text.
    """
    encoded = []
    for p in prompts:
        if p.open_turns:
            e = _encode_turns(p, tokenizer, chat)
        else:
            text = _render(p, tokenizer, chat)
            e = EncodedPrompt(
                p.prompt_id, text, tuple(tokenizer(text, add_special_tokens=not chat)["input_ids"])
            )
        if not e.token_ids:
            raise ProbeError(f"prompt {p.prompt_id} encodes to no tokens")
        if e.longest_trajectory(max_tokens) > max_context:
            raise ProbeError(_overflow(e, max_tokens, max_context))
        encoded.append(e)
    return encoded


def _overflow(e: EncodedPrompt, max_tokens: int, max_context: int) -> str:
    """What does not fit: the prompt and its responses, or for a multi-turn prompt its whole
    trajectory (the prompt, the given messages of later turns, every turn's response)."""
    if e.turns is None or e.turns.turns < 2:
        return (
            f"prompt {e.prompt_id} has {len(e.token_ids)} tokens; with --max-tokens {max_tokens} "
            f"it exceeds the model's context of {max_context} tokens"
        )
    given, n = e.turns.longest_context(), e.turns.turns
    return (
        f"prompt {e.prompt_id}: its {n}-turn trajectory can reach "
        f"{e.longest_trajectory(max_tokens)} tokens ({len(e.token_ids)} of the first prompt, "
        f"{given} of the messages given between turns, {n} x --max-tokens {max_tokens}), over "
        f"the model's context of {max_context} tokens; shorten the given messages or lower "
        "--max-tokens"
    )


def _render(p: Prompt, tokenizer: Any, chat: bool) -> str:
    messages = list(p.messages) if p.messages else [{"role": "user", "content": p.text or ""}]
    if chat:
        return render_chat(tokenizer, messages, True, p.prompt_id)
    return p.text if p.text is not None else "\n".join(m["content"] for m in messages)


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], generation: bool, pid: int) -> str:
    """``messages`` through the chat template, as text (``generation``: add the generation
    prompt)."""
    try:
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation
        )
    except Exception as exc:  # the template's own raise_exception(), jinja errors
        raise ProbeError(f"prompt {pid}: the chat template failed ({exc})") from None
    return str(rendered)


PLACEHOLDER = "\u2063probe-turn\u2063"  # stands for a generated turn's text while rendering


def _encode_turns(p: Prompt, tokenizer: Any, chat: bool) -> EncodedPrompt:
    """A multi-turn prompt's ``P0`` and ``TurnPlan`` (see the module docstring).

    Each boundary's ids are the text the template adds to the conversation rendered up to an
    assistant turn (placeholder content, no generation prompt) when the given messages and the
    next generation prompt follow: the template must render append-only there.
    """
    pid, messages = p.prompt_id, list(p.messages or ())
    if not chat:
        why = (
            "--no-chat turns it off"
            if getattr(tokenizer, "chat_template", None)
            else "the model's tokenizer has none"
        )
        raise ProbeError(f"prompt {pid}: multi-turn prompts need a chat template; {why}")
    opens = [i for i, m in enumerate(messages) if _is_open(m)]
    filled = [{**m, "content": PLACEHOLDER} if _is_open(m) else m for m in messages]
    text = render_chat(tokenizer, filled[: opens[0]], True, pid)
    encode = lambda t: tuple(tokenizer(t, add_special_tokens=False)["input_ids"])  # noqa: E731
    close = _close_text(render_chat(tokenizer, filled[: opens[0] + 1], False, pid), pid)
    eos = tokenizer.eos_token if isinstance(tokenizer.eos_token, str) else None
    end_id = tokenizer.eos_token_id if eos and close.startswith(eos) else None
    after_end, after_cut = [], []
    for k, i in enumerate(opens[:-1]):
        before = render_chat(tokenizer, filled[: i + 1], False, pid)
        after = render_chat(tokenizer, filled[: opens[k + 1]], True, pid)
        if not after.startswith(before):
            raise ProbeError(
                f"prompt {pid}: the chat template does not render the conversation "
                f"append-only after generated turn {k} (multi-turn prompts need it)"
            )
        given = after[len(before) :]
        after_end.append(encode(close[len(eos or "") :] + given) if end_id is not None else ())
        after_cut.append(encode(close + given))
    if end_id is None:
        after_end = list(after_cut)
    plan = TurnPlan(len(opens), end_id, tuple(after_end), tuple(after_cut), tuple(messages))
    ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
    return EncodedPrompt(pid, text, ids, plan)


def _close_text(rendered: str, pid: int) -> str:
    """What the template writes after an assistant message's content (its close)."""
    at = rendered.rfind(PLACEHOLDER)
    if at < 0:
        raise ProbeError(f"prompt {pid}: the chat template drops an assistant message's content")
    return rendered[at + len(PLACEHOLDER) :]


def decode_tokens(tokenizer: Any, token_ids: Any) -> list[str]:
    """Each token's text on its own (decoded once per distinct id); ``token_ids`` is a ``[N]``
    integer array. Shared by the scan's and ingest's token tables."""
    import numpy as np

    unique = np.unique(token_ids).tolist()
    text = dict(zip(unique, tokenizer.batch_decode([[t] for t in unique]), strict=True))
    return [text[t] for t in token_ids.tolist()]
