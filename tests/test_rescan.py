"""The outliers' re-scan command, run as printed: on an fp32 scan it reproduces the same
response tokens (each request's seed depends only on seed, prompt_id and sample_id). The same
scan shows ``train_entropy`` reaching the store, the metrics and the report."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow.parquet as pq
import pytest

from mismatch_probe import store
from tests.cli_runner import run_probe

TEXTS = ["What is the capital of France?", "Solve 3x + 5 = 20.", "def add(a, b):", "Hello there"]


def responses(run: Path) -> dict[tuple[int, int], list[int]]:
    """``(prompt_id, sample_id) -> response token ids`` of a scan."""
    table = pq.read_table(run / store.TOKENS_FILE).to_pylist()
    out: dict[tuple[int, int], list[int]] = {}
    for row in sorted(table, key=lambda r: (r["seq_id"], r["position"])):
        out.setdefault((row["prompt_id"], row["sample_id"]), []).append(row["token_id"])
    return out


@pytest.fixture(scope="module")
def base(tiny_model: Path) -> Path:
    """The directory holding the tiny model and this module's files (the working directory
    of the scans, so the printed paths are relative)."""
    return tiny_model.parent.parent


class _Uncaptured:
    """``capsys`` for a module fixture: pytest's own capture keeps the output."""

    def readouterr(self) -> Any:
        return SimpleNamespace(out="", err="")


@pytest.fixture(scope="module")
def first(base: Path, tiny_model: Path) -> Iterator[Path]:
    """An fp32 scan of 4 prompts x 2 samples, run from ``base``."""
    prompts = base / "rescan_prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXTS))
    mp, out = pytest.MonkeyPatch(), base / "rescan_first"
    mp.chdir(base)
    args = ["scan", "--model", str(tiny_model), "--prompts", str(prompts), "--max-tokens", "16",
            "--samples-per-prompt", "2", "--rollout-dtype", "float32", "--train-dtype", "float32",
            "--vllm-arg", f"kv_cache_memory_bytes={64 << 20}", "--out", str(out)]  # fmt: skip
    code, _, _ = run_probe(args, mp, _Uncaptured())
    assert code == 0
    yield out
    mp.undo()


def test_the_printed_command_reproduces_the_tokens(
    first: Path, base: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    out = first
    outliers = json.loads((out / store.METRICS_FILE).read_text())["outliers"]
    assert len(outliers) == len(TEXTS) * 2
    pick = next(o for o in outliers if o["sample_id"] == 1)  # the worst second sample
    command = pick["command"]
    assert command.startswith(f"probe scan --prompt-id {pick['prompt_id']} ")
    assert "--samples-per-prompt 2" in command and "--rollout-dtype float32" in command
    assert str(base) not in command and "rescan_prompts.jsonl" in command  # relative paths
    report = (out / store.REPORT_FILE).read_text()
    assert f"`{command}`" in report and str(base) not in report.split("## Outliers")[1]
    words = shlex.split(command)
    assert words[:2] == ["probe", "scan"]
    again = base / "rescan_again"
    code, _, err = run_probe([*words[1:], "--out", str(again)], monkeypatch, capsys)
    assert code == 0, err
    before, after = responses(out), responses(again)
    assert set(after) == {(pick["prompt_id"], 0), (pick["prompt_id"], 1)}
    for key, ids in after.items():
        assert ids == before[key], key  # the same response tokens


def test_entropy_reaches_store_metrics_and_report(first: Path) -> None:
    out = first
    tokens = pq.read_table(out / store.TOKENS_FILE)
    entropy = tokens.column("train_entropy")
    assert entropy.null_count == 0 and min(entropy.to_pylist()) >= 0.0
    metrics = json.loads((out / store.METRICS_FILE).read_text())
    assert metrics["entropy_mean"] == pytest.approx(sum(entropy.to_pylist()) / len(entropy))
    assert metrics["curves"]["entropy"]["available"] is True
    assert (out / "plots" / "entropy.png").is_file()
    report = (out / store.REPORT_FILE).read_text()
    assert "## Mismatch by entropy" in report and "not available" not in report


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--prompt-id", "9"], "--prompt-id 9: "),
        (["--prompt-id", "-1"], "--prompt-id must be >= 0"),
        (["--prompt-id", "0", "--num-prompts", "2"], "--prompt-id and --num-prompts"),
    ],
)
def test_bad_prompt_ids_fail_before_any_engine(
    extra: list[str], message: str, tiny_model: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXTS))
    args = ["scan", "--model", str(tiny_model), "--prompts", str(prompts), *extra]
    code, _, err = run_probe([*args, "--out", str(tmp_path / "out")], monkeypatch, capsys)
    assert code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "out" / store.TOKENS_FILE).exists()


def test_the_command_keeps_a_hub_id_and_batch_invariance(tmp_path: Path) -> None:
    """A model read from the Hugging Face cache is re-scanned by its hub id (its snapshot path is
    this machine's cache), and a batch-invariant run asks for batch invariance again."""
    from mismatch_probe.pipeline.config import ScanConfig
    from mismatch_probe.rundir.rescan import rescan_command

    config = ScanConfig(rollout_dtypes=("float32",), batch_invariant=True).to_dict()
    run = {
        "config": config,
        "setting": config["settings"][0],
        "settings": config["settings"],
        "model": {"hub_id": "Org/Tiny", "revision": "abc123"},
        "sampling": {},
    }
    command = rescan_command(run, {"prompt_id": 3, "sample_id": 0}, tmp_path)
    assert command is not None
    assert "--model Org/Tiny@abc123" in command and "--prompt-id 3" in command
    assert "--vllm-arg VLLM_BATCH_INVARIANT=1" in command
    assert command.count("--model") == 1
