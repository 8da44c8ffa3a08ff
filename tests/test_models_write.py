"""``probe models tiny`` on a full disk: one line on stderr, exit 2, nothing half-written left
(the disk-full error simulated at the weights' write, where safetensors meets it)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from safetensors import SafetensorError

from tests.cli_runner import run_probe

FULL_DISK = {
    "oserror": OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
    "safetensors": SafetensorError(
        'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
        'left on device" })'
    ),
}


def full_disk(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    import transformers.modeling_utils

    def save_file(*args: object, **kwargs: object) -> None:
        Path(str(args[1])).write_bytes(b"half a tensor")  # what the write got to before failing
        raise error

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", save_file)


@pytest.mark.parametrize("kind", list(FULL_DISK))
def test_models_tiny_on_a_full_disk_leaves_nothing(
    kind: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    full_disk(monkeypatch, FULL_DISK[kind])
    out = tmp_path / "new" / "tiny"
    code, stdout, err = run_probe(["models", "tiny", str(out)], monkeypatch, capsys)
    assert code == 2
    assert err.strip().count("\n") == 0 and "Traceback" not in err
    assert "No space left on device" in err and str(out) in err
    assert stdout == ""
    assert list(tmp_path.iterdir()) == []  # no empty OUT, no parent made for it, no temp dir


def test_models_tiny_on_a_full_disk_keeps_an_existing_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    full_disk(monkeypatch, FULL_DISK["safetensors"])
    out = tmp_path / "tiny"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, _, err = run_probe(["models", "tiny", str(out)], monkeypatch, capsys)
    assert code == 2 and "No space left on device" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # its file kept, nothing added
