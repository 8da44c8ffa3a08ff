"""Tiny random-weight checkpoints for tests and for trying the tool without a real model.

A tiny model is a normal transformers checkpoint directory: a byte-level BPE tokenizer trained
here on a small built-in text (so any string encodes), a chat template, and a model with random
weights whose head_dim is 32 (the smallest the vLLM CPU attention backend accepts).

``ARCHS`` maps an architecture name to its config builder: ``llama`` (dense), and two
mixture-of-experts models with 8 experts, top-2 routing in every layer: ``qwen3_moe``
(Qwen3-MoE, renormalised top-k weights) and ``mixtral`` (Mixtral).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mismatch_probe import store
from mismatch_probe.errors import ProbeError
from mismatch_probe.models.checkpoint import save_checkpoint

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A language model predicts the next token.
What is the capital of France? Paris is the capital of France. Two plus two equals four.
def add(a, b): return a + b  # Python code with numbers 0 1 2 3 4 5 6 7 8 9.
Reinforcement learning trains a policy from rewards; rollouts come from an inference engine.
Solve for x: 3x + 5 = 20, so x = 5. Explain why the sky is blue in one sentence.
"""

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_SPECIAL = ["<|end|>", "<|user|>", "<|assistant|>", "<|system|>", "<|pad|>"]


def build_tokenizer(vocab_size: int = 384) -> Any:
    """A byte-level BPE tokenizer with a chat template; ``<|end|>`` is EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # its progress lines went to stdout, before the path printed
    )
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _llama(vocab: int, eos: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.08,
        eos_token_id=eos,
        bos_token_id=None,
        architectures=["LlamaForCausalLM"],
    )


# The shared shape of the tiny MoE models: 2 layers, 8 experts, top-2, head_dim 32.
_MOE_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "initializer_range": 0.08,
    "num_experts_per_tok": 2,
    "bos_token_id": None,
}


def _qwen3_moe(vocab: int, eos: int) -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **_MOE_SHAPE,
        vocab_size=vocab,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_experts=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        eos_token_id=eos,
        architectures=["Qwen3MoeForCausalLM"],
    )


def _mixtral(vocab: int, eos: int) -> Any:
    from transformers import MixtralConfig

    return MixtralConfig(
        **_MOE_SHAPE,
        vocab_size=vocab,
        intermediate_size=64,
        num_local_experts=8,
        eos_token_id=eos,
        architectures=["MixtralForCausalLM"],
    )


ARCHS: dict[str, Callable[[int, int], Any]] = {
    "llama": _llama,
    "qwen3_moe": _qwen3_moe,
    "mixtral": _mixtral,
}


def build_tiny_model(
    out: Path, arch: str = "llama", seed: int = 0, context: int = 512, tied: bool = False
) -> Path:
    """Write a tiny random-weight checkpoint of ``arch`` to ``out`` (fp32 safetensors) whose
    context (``max_position_embeddings``) is ``context`` tokens (``tied``: the LM head is the
    embedding, as in SmolLM2).

    ``out`` is checked writable first (nothing is created until the model is built); the files
    are saved into a hidden directory, inside ``out`` when it exists (its other files are kept)
    or beside it, renamed into place when all are complete: a failed write (a full disk) is one
    line and leaves no partial file, no empty ``out`` and no parent directory it made.
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if arch not in ARCHS:
        raise ProbeError(f"unknown tiny architecture {arch!r}; choose from {', '.join(ARCHS)}")
    store.check_writable(out, "OUT")
    tokenizer = build_tokenizer()
    config = ARCHS[arch](len(tokenizer), tokenizer.eos_token_id)
    config.max_position_embeddings = context
    config.tie_word_embeddings = tied
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one shard: a bar would only add noise
    try:
        if out.is_dir():
            with store.atomic_files(out) as tmp:
                save_checkpoint(model, tokenizer, tmp, out)
        else:
            with store.made_parents(out), store.atomic_dir(out, is_checkpoint) as tmp:
                save_checkpoint(model, tokenizer, tmp, out)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return out


def is_checkpoint(path: Path) -> bool:
    """A checkpoint was published at ``path`` (``store.atomic_dir`` publishes only whole ones)."""
    return (path / "config.json").is_file()
