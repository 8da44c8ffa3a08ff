"""``--model org/name[@revision]``: read from a Hugging Face cache that the test lays out as
``huggingface_hub`` does (refs, snapshots linking into blobs), with the network blocked."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest

from mismatch_probe import models
from mismatch_probe.errors import ProbeError
from mismatch_probe.models import hub
from tests.cli_runner import run_probe

REPO = "tiny-org/tiny-llama"
MAIN = "a" * 40  # the commit refs/main points to
V1 = "b" * 40  # the commit of tag v1


def add_snapshot(folder: Path, source: Path, commit: str) -> Path:
    """``source``'s files as a snapshot: content in blobs/<sha256>, relative links to them."""
    snapshot = folder / "snapshots" / commit
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        data = path.read_bytes()
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / path.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


@pytest.fixture
def hub_cache(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A hub cache holding REPO at main and at tag v1, found through HF_HUB_CACHE."""
    cache = tmp_path / "hf" / "hub"
    folder = cache / ("models--" + REPO.replace("/", "--"))
    add_snapshot(folder, tiny_model, MAIN)
    add_snapshot(folder, tiny_model, V1)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(MAIN)
    (folder / "refs" / "v1").write_text(V1)
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return folder


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"network access: {args}")

    monkeypatch.setattr(socket.socket, "connect", refused)
    monkeypatch.setattr(socket, "create_connection", refused)


def test_what_is_a_hub_id() -> None:
    assert hub.parse_hub_id("Qwen/Qwen3-0.6B") == ("Qwen/Qwen3-0.6B", "main")
    assert hub.parse_hub_id("Qwen/Qwen3-0.6B@v1.0") == ("Qwen/Qwen3-0.6B", "v1.0")
    assert hub.parse_hub_id(f"org/name@{MAIN}") == ("org/name", MAIN)
    for path in ("./org/name", "/models/x", "a/b/c", "name", "org/x.gguf", "org/", "-o/x"):
        assert hub.parse_hub_id(path) is None, path


def test_cache_location_follows_huggingface_hub(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hub.hub_cache_dir() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub.hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    assert hub.hub_cache_dir() == tmp_path / "hfhome" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hubcache"))
    assert hub.hub_cache_dir() == tmp_path / "hubcache"


@pytest.mark.usefixtures("no_network")
def test_hub_ids_resolve_to_cached_snapshots(hub_cache: Path) -> None:
    snapshots = hub_cache / "snapshots"
    assert models.resolve_model(Path(REPO)) == snapshots / MAIN
    assert models.resolve_model(Path(f"{REPO}@v1")) == snapshots / V1
    assert models.resolve_model(Path(f"{REPO}@{V1}")) == snapshots / V1
    assert models.model_name(snapshots / V1) == "tiny-llama"  # labels, reports/<name>-<time>/
    assert hub.hub_origin(snapshots / V1) == (REPO, V1)
    assert hub.hub_origin(hub_cache.parent) is None


@pytest.mark.usefixtures("no_network")
def test_a_scan_prepares_a_hub_model_offline(hub_cache: Path) -> None:
    """The scan's first stage (tokenizer, config, weights check, prompts) on the snapshot: what
    vLLM and transformers then load from the same local directory."""
    from mismatch_probe.pipeline.config import ScanConfig
    from mismatch_probe.pipeline.scan import prepare

    prep = prepare(ScanConfig(model=Path(f"{REPO}@v1"), num_prompts=2, chat=False))
    assert prep.model_dir == hub_cache / "snapshots" / V1 and len(prep.prompts) == 2
    assert prep.tokenizer.vocab_size > 0


def test_a_missing_model_says_where_it_looked_and_how_to_download(
    hub_cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    code, _, err = run_probe(["scan", "--model", "nobody/nothing"], monkeypatch, capsys)
    folder = hub_cache.parent / "models--nobody--nothing"
    assert code == 2 and err == (
        "error: model nobody/nothing: no such local path, and not in the Hugging Face cache "
        f"(looked in {folder}); "
        "download it where there is network access with `hf download nobody/nothing` (then "
        "point HF_HUB_CACHE or HF_HOME at that cache), or pass a local checkpoint directory\n"
    )
    with pytest.raises(ProbeError, match=r"revision v2 of tiny-org/tiny-llama is not in the") as e:
        models.resolve_model(Path(f"{REPO}@v2"))
    assert f"cached: main, v1, {MAIN[:12]}, {V1[:12]})" in str(e.value)
    assert "`hf download tiny-org/tiny-llama --revision v2`" in str(e.value)


def test_an_incomplete_download_is_named(hub_cache: Path) -> None:
    (hub_cache / "snapshots" / MAIN / "config.json").resolve().unlink()  # the blob is gone
    with pytest.raises(ProbeError, match=r"has no config\.json: an incomplete download"):
        models.resolve_model(Path(REPO))


def test_a_local_directory_of_that_shape_wins(
    hub_cache: Path, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = tmp_path / "work"
    shutil.copytree(tiny_model, local / REPO)
    monkeypatch.chdir(local)
    assert models.resolve_model(Path(REPO)) == Path(REPO)
    with pytest.raises(ProbeError, match=r"model nope/x: no such local path, and not in the"):
        models.resolve_model(Path("./nope/x"))  # (the shell's ./ is gone in a Path)
    with pytest.raises(ProbeError, match=r"model path does not exist: /nope/x \(--model takes"):
        models.resolve_model(Path("/nope/x"))


def test_a_revision_never_leaves_the_cache() -> None:
    """``org/tiny@../../../x`` is no revision: refused before any path is built from it."""
    for revision in ("../../../x", "a/../../b", "/etc", "x/", "a\\b", "."):
        with pytest.raises(ProbeError, match="is not a branch, tag or commit name"):
            hub.parse_hub_id(f"org/tiny@{revision}")
    assert hub.parse_hub_id("org/tiny@refs/pr/1") == ("org/tiny", "refs/pr/1")
