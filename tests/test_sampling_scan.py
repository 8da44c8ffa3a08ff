"""The misaligned-settings checks stay silent on real scans whose two sides share their sampling
settings: a scan at T = 0.7 and one at top-p 0.9, processed log-probs on both sides (the
rescorer applies the engine's temperature and nucleus: ``shared/spec/rescoring.md``).

``test_sampling_checks.py`` shows the same checks firing when the settings differ.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from mismatch_probe import store
from mismatch_probe.metrics.integrity import IntegrityAccumulator, _columns
from mismatch_probe.metrics.sampling_checks import SAMPLING_CHECKS
from tests.cli_runner import run_probe

pytestmark = pytest.mark.engine

SIZE = ["--num-prompts", "8", "--samples-per-prompt", "2", "--max-tokens", "16"]


@pytest.mark.parametrize("setting", [["--temperature", "0.7"], ["--top-p", "0.9"]])
def test_silent_when_both_sides_share_the_setting(
    setting: list[str],
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
) -> None:
    out = tmp_path / "run"
    args = ["scan", "--model", str(tiny_model), *SIZE, *setting, "--out", str(out)]
    code, _, err = run_probe(args, monkeypatch, capsys)
    assert code == 0, err
    found = json.loads((out / "integrity.json").read_text())["findings"]
    assert not {f["check"] for f in found} & set(SAMPLING_CHECKS), found
    acc = IntegrityAccumulator()  # the checks had the tokens they need to be able to fire
    acc.update(*_columns(pq.read_table(store.resolve_tokens_path(out))))
    assert acc.sampling.n > 100 and acc.sampling.findings() == []
