"""Shared fixtures: a tiny random model built once, and real vLLM engines shared per session.

``make test`` runs the suite on two pytest-xdist workers, one test module per worker at a time
(``--dist loadfile``: a module's tests share its engines and fixtures), the slowest modules
first (``FIRST``), so that neither worker is left with a long module at the end.

An engine starts in a few seconds (in process, the CPU default) and still costs more than most
tests, so engines live in a session-wide pool keyed by (dtype, logprobs mode): each
configuration starts once; the pool keeps one engine alive at a time (tests that share a
configuration sit together in their module).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests build their models; nothing downloads
# pytest-xdist starts its workers with COLUMNS=80 and LINES=24, and probe's output honours COLUMNS
# when stdout is no terminal: the tests read that output as a CI log has it, with neither set.
for name in ("COLUMNS", "LINES"):
    os.environ.pop(name, None)

# The slowest modules, slowest first (measured with ``--durations``): scheduled before the rest.
FIRST = (
    "test_sharded_scan.py",
    "test_verl_wiring.py",
    "test_multiturn_default.py",
    "test_lifecycle.py",
    "test_matrix.py",
    "test_docs_excerpts.py",
    "test_watch.py",
    "test_faults.py",
    "test_scan_cli.py",
    "test_routing_engine.py",
    "test_ingest_formats.py",
    "test_ingest_hooks.py",
    "test_ingest_pickle.py",
    "test_routing_scan.py",
    "test_attribution_cli.py",
    "test_identity.py",
    "test_multiturn_scan.py",
    "test_selftest.py",
    "test_layer_streams.py",
)

TINY_CONTEXT = 512
# The prompts of the engine tests (identity, routing): short, varied, chat-templated.
PROMPT_TEXTS = (
    "What is the capital of France?",
    "Solve for x: 3x + 5 = 20.",
    "def add(a, b):",
    "Explain why the sky is blue in one sentence.",
    "Two plus two equals",
    "The quick brown fox",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules of ``FIRST`` first, in its order; the rest as collected (a stable sort)."""
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))


def encoded_prompts(tokenizer: Any, max_tokens: int = 64) -> list[Any]:
    """``PROMPT_TEXTS`` through ``tokenizer``'s chat template, as the scan encodes them."""
    from mismatch_probe.prompts import Prompt, encode_prompts

    raw = [Prompt(i, text=t) for i, t in enumerate(PROMPT_TEXTS)]
    return encode_prompts(raw, tokenizer, True, TINY_CONTEXT, max_tokens)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mismatch_probe.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def _groups_alive() -> bool:
    from vllm.distributed import parallel_state

    return bool(parallel_state.model_parallel_is_initialized())


class EnginePool:
    """Real vLLM engines on the tiny model, one configuration alive at a time."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.key: tuple[str, str] | None = None
        self._cm: Any = None
        self.llm: Any = None

    def get(self, dtype: str, logprobs_mode: str) -> Any:
        from mismatch_probe.engine import rollout
        from mismatch_probe.sampling import SamplingSpec
        from mismatch_probe.settings import RolloutSetting

        if self.key is not None and not _groups_alive():
            # a test's own in-process engine (a scan, a refit) stopped since: its shutdown took
            # down vLLM's process-wide parallel groups, which this engine runs in
            self.close()
        if self.key != (dtype, logprobs_mode):
            self.close()
            spec = SamplingSpec(logprobs_mode=logprobs_mode)  # type: ignore[arg-type]
            kwargs = rollout.engine_kwargs(
                self.model,
                RolloutSetting(dtype),
                spec,
                TINY_CONTEXT,
                {"kv_cache_memory_bytes": 128 << 20},
            )
            self._cm = rollout.engine(kwargs)
            self.llm = self._cm.__enter__()
            self.key = (dtype, logprobs_mode)
        return self.llm

    def close(self) -> None:
        if self._cm is not None:
            self._cm.__exit__(None, None, None)
        self._cm, self.llm, self.key = None, None, None


@pytest.fixture(scope="session")
def engines(tiny_model: Path) -> Iterator[EnginePool]:
    pool = EnginePool(tiny_model)
    yield pool
    pool.close()
