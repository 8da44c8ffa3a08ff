"""Prompt files and multi-turn prompts that cannot run: one line that says what is wrong."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from mismatch_probe.errors import ProbeError
from mismatch_probe.prompts import Prompt, encode_prompts, load_prompts

CONVERSATION = (
    {"role": "user", "content": "What is two plus two? Use the calculator."},
    {"role": "assistant", "content": None},
    {"role": "tool", "content": "4 " * 200},  # a long tool message between the turns
    {"role": "assistant", "content": None},
)


def test_lone_surrogate_in_a_prompts_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": "bad \\ud800 text"}\n')
    with pytest.raises(ProbeError, match=r"p\.jsonl:2: a lone UTF-16 surrogate"):
        load_prompts(path)


def test_multi_turn_without_a_template_says_which(tiny_tokenizer: Any) -> None:
    raw = [Prompt(0, messages=CONVERSATION[:2])]
    with pytest.raises(ProbeError, match="--no-chat turns it off"):
        encode_prompts(raw, tiny_tokenizer, False, 512, 8)
    bare = copy.deepcopy(tiny_tokenizer)
    bare.chat_template = None
    with pytest.raises(ProbeError, match="the model's tokenizer has none"):
        encode_prompts(raw, bare, False, 512, 8)


def test_multi_turn_overflow_names_the_trajectory(tiny_tokenizer: Any) -> None:
    raw = [Prompt(0, messages=CONVERSATION)]
    with pytest.raises(ProbeError) as info:
        encode_prompts(raw, tiny_tokenizer, True, 256, 16)
    message = str(info.value)
    assert "2-turn trajectory can reach" in message
    assert (
        "of the messages given between turns" in message
        and "over the model's context of 256" in message
    )
