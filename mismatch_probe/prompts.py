"""Prompt sets: JSONL files, one object a line, with ``prompt`` (text) or ``messages`` (chat).

``load_prompts`` validates the file and reports the first bad line by number. ``encode_prompts``
turns prompts into token ids with the model's tokenizer (applying its chat template when asked),
so that both the engine and the rescorer see exactly the same ids.
"""

from __future__ import annotations

import json
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
    messages: tuple[dict[str, str], ...] | None = None


@dataclass(frozen=True)
class EncodedPrompt:
    prompt_id: int
    text: str  # what the model sees (after the chat template)
    token_ids: tuple[int, ...]


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


def _parse_line(line: str, lineno: int, prompt_id: int, path: Path) -> Prompt:
    where = f"{path}:{lineno}"
    try:
        obj: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ProbeError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ProbeError(f"{where}: expected a JSON object with 'prompt' or 'messages'")
    if isinstance(obj.get("prompt"), str) and obj["prompt"].strip():
        return Prompt(prompt_id, text=obj["prompt"])
    messages = obj.get("messages")
    if isinstance(messages, list) and messages and all(map(_is_message, messages)):
        return Prompt(prompt_id, messages=tuple(dict(m) for m in messages))
    raise ProbeError(
        f"{where}: needs a non-empty 'prompt' string or a 'messages' list of "
        "{'role': str, 'content': str} objects"
    )


def _is_message(m: Any) -> bool:
    return (
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
    )


def encode_prompts(
    prompts: list[Prompt], tokenizer: Any, chat: bool, max_context: int, max_tokens: int
) -> list[EncodedPrompt]:
    """Render and tokenize prompts; fail if a prompt plus ``max_tokens`` exceeds the context.

    With ``chat`` the tokenizer's chat template is applied (a plain ``prompt`` becomes one user
    message); without it, ``messages`` are joined by newlines as plain text.
    """
    encoded = []
    for p in prompts:
        text = _render(p, tokenizer, chat)
        ids = tuple(tokenizer(text, add_special_tokens=not chat)["input_ids"])
        if not ids:
            raise ProbeError(f"prompt {p.prompt_id} encodes to no tokens")
        if len(ids) + max_tokens > max_context:
            raise ProbeError(
                f"prompt {p.prompt_id} has {len(ids)} tokens; with --max-tokens {max_tokens} "
                f"it exceeds the model's context of {max_context} tokens"
            )
        encoded.append(EncodedPrompt(p.prompt_id, text, ids))
    return encoded


def _render(p: Prompt, tokenizer: Any, chat: bool) -> str:
    messages = list(p.messages) if p.messages else [{"role": "user", "content": p.text or ""}]
    if chat:
        try:
            rendered = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # the template's own raise_exception(), jinja errors
            raise ProbeError(f"prompt {p.prompt_id}: the chat template failed ({exc})") from None
        return str(rendered)
    return p.text if p.text is not None else "\n".join(m["content"] for m in messages)
