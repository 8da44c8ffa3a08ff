"""Every bad input of ``probe ingest``: one line on stderr, exit code 2, nothing in ``--out``
(not even a partial directory beside it), nothing already there lost."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.cli_runner import run_probe_err as run_main
from tests.ingest_fixtures import (
    synthetic_steps,
    write_nemo_rl,
    write_prime_rl,
    write_slime,
)


def _prime(tmp: Path) -> Path:
    return write_prime_rl(tmp / "src", synthetic_steps([1, 2, 3], seqs=2))


def _rewrite_line(path: Path, index: int, edit: Callable[[dict], Any]) -> None:
    lines = path.read_text().splitlines()
    obj = json.loads(lines[index])
    edit(obj)
    lines[index] = json.dumps(obj)
    path.write_text("\n".join(lines) + "\n")


def missing_dir(tmp: Path) -> tuple[list[str], str]:
    return ["prime-rl", str(tmp / "nowhere")], "no such file or directory"


def gap_without_stable(tmp: Path) -> tuple[list[str], str]:
    src = _prime(tmp)
    (src / "token_exports" / "step_2" / "STABLE").unlink()
    return ["prime-rl", str(src)], "step_2: no STABLE marker"


def chosen_step_without_stable(tmp: Path) -> tuple[list[str], str]:
    src = _prime(tmp)
    (src / "token_exports" / "step_3" / "STABLE").unlink()
    return ["prime-rl", str(src), "--steps", "1:3"], "step_3: no STABLE marker"


def unequal_lengths(tmp: Path) -> tuple[list[str], str]:
    src = _prime(tmp)
    file = src / "token_exports" / "step_2" / "rank_0.jsonl"
    _rewrite_line(file, 1, lambda o: o["trainer_logprobs"].pop())
    return ["prime-rl", str(src)], "rank_0.jsonl:2: arrays of unequal length"


def empty_loss_mask(tmp: Path) -> tuple[list[str], str]:
    src = _prime(tmp)
    file = src / "token_exports" / "step_3" / "rank_0.jsonl"
    _rewrite_line(file, 0, lambda o: o.update(loss_mask=[False] * len(o["loss_mask"])))
    return ["prime-rl", str(src)], "rank_0.jsonl:1: the loss mask selects no token"


def bad_json_line(tmp: Path) -> tuple[list[str], str]:
    src = write_nemo_rl(tmp / "src", synthetic_steps([1, 2], seqs=3))
    file = src / "train_data_step2.jsonl"
    lines = file.read_text().splitlines()
    lines[2] = lines[2][:-5]
    file.write_text("\n".join(lines) + "\n")
    return ["nemo-rl", str(src)], "train_data_step2.jsonl:3: not valid JSON"


def zero_prev_logprobs(tmp: Path) -> tuple[list[str], str]:
    src = write_nemo_rl(tmp / "src", synthetic_steps([1, 2], seqs=2))
    file = src / "train_data_step2.jsonl"
    for i in range(2):
        _rewrite_line(file, i, lambda o: o.update(prev_logprobs=[[0.0] * 16]))
    return ["nemo-rl", str(src)], "prev_logprobs are all zero"


def pickle_needed(tmp: Path) -> tuple[list[str], str]:
    import torch

    from tests.ingest_fixtures import slime_payload

    src = write_slime(tmp / "src", synthetic_steps([1, 2], seqs=2))
    payload = slime_payload(2, synthetic_steps([2], seqs=1)[2])
    payload["samples"][0]["rewards"] = np.array([1.0])  # not loadable weights-only
    torch.save(payload, src / "train_data" / "2.pt")
    return ["slime", str(src)], "--trust-pickle"


def unknown_format(tmp: Path) -> tuple[list[str], str]:
    return ["openrlhf", str(_prime(tmp))], "unknown format 'openrlhf'"


def miles_without_model(tmp: Path) -> tuple[list[str], str]:
    return ["miles-parquet", str(tmp)], "give --model"


def bad_steps(tmp: Path) -> tuple[list[str], str]:
    return ["prime-rl", str(_prime(tmp)), "--steps", "5:2"], "--steps '5:2'"


def no_step_in_range(tmp: Path) -> tuple[list[str], str]:
    return ["prime-rl", str(_prime(tmp)), "--steps", "10:"], "no step directory"


def unknown_schema_version(tmp: Path) -> tuple[list[str], str]:
    src = _prime(tmp)
    file = src / "token_exports" / "step_1" / "rank_0.jsonl"
    _rewrite_line(file, 0, lambda o: o.update(schema_version=9))
    return ["prime-rl", str(src)], "schema_version 9"


CASES = [
    missing_dir,
    gap_without_stable,
    chosen_step_without_stable,
    unequal_lengths,
    empty_loss_mask,
    bad_json_line,
    zero_prev_logprobs,
    pickle_needed,
    unknown_format,
    miles_without_model,
    bad_steps,
    no_step_in_range,
    unknown_schema_version,
]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_bad_input_is_one_line_exit_2_and_nothing_written(
    case: Callable[[Path], tuple[list[str], str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
) -> None:
    args, message = case(tmp_path)
    out = tmp_path / "runs" / "run"
    code, err = run_main(["ingest", *args, "--out", str(out)], monkeypatch, capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert "Traceback" not in err
    assert not out.exists()
    assert not (tmp_path / "runs").exists() or list((tmp_path / "runs").iterdir()) == []


def test_a_non_empty_out_is_refused_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    code, err = run_main(["ingest", "prime-rl", str(_prime(tmp_path)), "--out", str(out)],
                         monkeypatch, capsys)  # fmt: skip
    assert code == 2 and "not an empty directory" in err
    assert [p.name for p in out.iterdir()] == ["mine.txt"]


def test_trust_pickle_loads_what_weights_only_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    args, _ = pickle_needed(tmp_path)
    out = tmp_path / "run"
    code, err = run_main(["ingest", *args, "--out", str(out), "--trust-pickle"], monkeypatch,
                         capsys)  # fmt: skip
    assert code == 0, err
    assert json.loads((out / "run.json").read_text())["counts"]["steps"] == 2
