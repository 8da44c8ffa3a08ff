"""Hugging Face hub ids (``org/name``, ``org/name@revision``) resolved from the local cache,
never downloaded.

vLLM, lm_eval, TRL and verl users name models by hub id; probe accepts the same names but reads
only what ``huggingface_hub`` already put in its cache, laid out as::

    $HF_HUB_CACHE/models--org--name/refs/main          the commit hash a branch or tag points to
    $HF_HUB_CACHE/models--org--name/snapshots/<commit>/ the files (links into blobs/)
    $HF_HUB_CACHE/models--org--name/blobs/<hash>        the content

The cache is ``HF_HUB_CACHE`` (or the older ``HUGGINGFACE_HUB_CACHE``), else ``HF_HOME/hub``,
else ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``, as in
``huggingface_hub``. No network access, no ``huggingface_hub`` import: a model that is not there
is an error that says where it was looked for and how to download it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from mismatch_probe.errors import ProbeError

# org/name[@revision]: what the hub allows in a repo id (letters, digits, '-', '_', '.').
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>\S+))?")
COMMIT = re.compile(r"[0-9a-f]{40}")


def parse_hub_id(text: str) -> tuple[str, str] | None:
    """``"org/name@rev"`` -> ``("org/name", "rev")`` (revision ``main`` when absent); None when
    ``text`` is not a hub id (a path such as ``./x``, ``/a/b``, ``a/b/c`` or ``x.gguf``)."""
    match = HUB_ID.fullmatch(text)
    if match is None or text.endswith(".gguf"):
        return None
    revision = match["revision"] or "main"
    if not _safe_revision(revision):
        raise ProbeError(
            f"{text}: revision {revision!r} is not a branch, tag or commit name (no '..', "
            "no leading or trailing '/', no '\\')"
        )
    return match["repo"], revision


def _safe_revision(revision: str) -> bool:
    """A git ref name or a commit: never a path out of the cache (``../../x``, ``/etc``)."""
    parts = revision.split("/")
    return "\\" not in revision and all(p and p not in (".", "..") for p in parts)


def hub_cache_dir() -> Path:
    """Where ``huggingface_hub`` keeps downloaded repositories (see the module docstring)."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "huggingface" / "hub"


def repo_folder(repo: str) -> Path:
    return hub_cache_dir() / ("models--" + repo.replace("/", "--"))


def resolve_hub_id(text: str) -> Path:
    """The cached snapshot directory of hub id ``text`` (``org/name`` or ``org/name@revision``;
    a revision is a branch, a tag or a commit hash)."""
    parsed = parse_hub_id(text)
    if parsed is None:
        raise ProbeError(f"{text!r} is not a hub id (org/name or org/name@revision)")
    repo, revision = parsed
    folder = repo_folder(repo)
    get = f"hf download {repo}" + ("" if revision == "main" else f" --revision {revision}")
    how = (
        f"download it where there is network access with `{get}` (then point HF_HUB_CACHE or "
        "HF_HOME at that cache), or pass a local checkpoint directory"
    )
    if not folder.is_dir():
        raise ProbeError(
            f"model {text}: no such local path, and not in the Hugging Face cache (looked in "
            f"{folder}); {how}"
        )
    commit = _commit(folder, revision)
    if commit is None:
        cached = ", ".join(_cached_revisions(folder)) or "none"
        raise ProbeError(
            f"revision {revision} of {repo} is not in the Hugging Face cache (looked in "
            f"{folder / 'refs'} and {folder / 'snapshots'}; cached: {cached}); {how}"
        )
    snapshot = folder / "snapshots" / commit
    if not (snapshot / "config.json").is_file():  # a missing file or a link to a missing blob
        raise ProbeError(
            f"the cached snapshot of {text} ({snapshot}) has no config.json: an incomplete "
            f"download; {how}"
        )
    return snapshot


def _commit(folder: Path, revision: str) -> str | None:
    """The commit hash ``revision`` names in the cache: a ref's content, or the hash itself."""
    if COMMIT.fullmatch(revision) and (folder / "snapshots" / revision).is_dir():
        return revision
    ref = folder / "refs" / revision
    if ref.is_file():
        commit = ref.read_text().strip()  # a hash, never a path (a crafted ref file)
        ok = COMMIT.fullmatch(commit) and (folder / "snapshots" / commit).is_dir()
        return commit if ok else None
    return None


def _cached_revisions(folder: Path) -> list[str]:
    refs = folder / "refs"
    names = sorted(str(p.relative_to(refs)) for p in refs.rglob("*") if p.is_file())
    snapshots = folder / "snapshots"
    commits = sorted(p.name for p in snapshots.iterdir()) if snapshots.is_dir() else []
    return names + [c[:12] for c in commits]


def hub_origin(model_dir: Path) -> tuple[str, str] | None:
    """``(repo id, commit)`` when ``model_dir`` is a snapshot of the hub cache, else None."""
    parent = model_dir.parent
    if parent.name != "snapshots" or not parent.parent.name.startswith("models--"):
        return None
    return "/".join(parent.parent.name.split("--")[1:]), model_dir.name
