"""Checks that a checkpoint's files can be loaded, before an engine is started on them.

vLLM finds weights with ``glob.glob(os.path.join(folder, "*.safetensors"))`` (its
``default_loader``), so a folder whose path holds glob characters (``[ab]``) finds no weights;
and a truncated or corrupt weights file fails deep inside the engine's start, its cause lost in
the child process's log. Both are checked here from the files alone (a safetensors header is an
8-byte little-endian length and a JSON table of tensors with their byte ranges), in milliseconds.
"""

from __future__ import annotations

import glob
import json
import math
from pathlib import Path
from typing import Any

from mismatch_probe.errors import ProbeError

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")  # what vLLM's default loader looks for
# Bytes per element of each safetensors dtype (those of fractional size are not checked).
DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
    "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
}  # fmt: skip
MAX_HEADER = 100_000_000  # the safetensors format's own bound on the header
GGUF_MAGIC = b"GGUF"


def check_weights(model_dir: Path) -> None:
    """Fail with one line unless vLLM can find and read ``model_dir``'s weights.

    Raises:
        ProbeError: a path vLLM would glob, no weights file, or a safetensors file whose
            header does not parse or whose size disagrees with it.
    """
    if glob.has_magic(str(model_dir)):
        raise ProbeError(
            f"{model_dir}: vLLM cannot load a model from a path holding [, ], * or ? (it "
            "globs the folder for weights); rename the folder or link to it from a plain path"
        )
    found = [p for pattern in WEIGHT_PATTERNS for p in sorted(model_dir.glob(pattern))]
    if not found:
        patterns = ", ".join(WEIGHT_PATTERNS)
        raise ProbeError(f"{model_dir} holds no weights file ({patterns})")
    for path in found:
        if path.suffix == ".safetensors":
            check_safetensors(path)


def check_safetensors(path: Path) -> None:
    """The header parses and the tensors it lists fill the file exactly."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < length <= min(MAX_HEADER, size - 8):
                raise _corrupt(path, "truncated or not safetensors (bad header length)")
            header = json.loads(f.read(length))
    except OSError as exc:
        raise ProbeError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise _corrupt(path, "its header is not valid JSON") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "its header is not a table of tensors")
    end = max((_tensor_end(path, name, t) for name, t in header.items() if name != "__metadata__"),
              default=0)  # fmt: skip
    if 8 + length + end != size:
        expected = 8 + length + end
        raise _corrupt(path, f"{size} bytes where its header describes {expected} (truncated?)")


def _tensor_end(path: Path, name: str, tensor: Any) -> int:
    """The end of a tensor's byte range, checked against its dtype and shape."""
    try:
        start, stop = (int(x) for x in tensor["data_offsets"])
        shape = [int(x) for x in tensor["shape"]]
        dtype = str(tensor["dtype"])
    except (KeyError, TypeError, ValueError):
        raise _corrupt(path, f"tensor {name!r} has no valid data_offsets/shape/dtype") from None
    width = DTYPE_BYTES.get(dtype)
    if not 0 <= start <= stop or (width is not None and stop - start != width * math.prod(shape)):
        raise _corrupt(path, f"tensor {name!r} has an inconsistent byte range")
    return stop


def _corrupt(path: Path, why: str) -> ProbeError:
    return ProbeError(f"{path} is not a readable safetensors file: {why}")


def check_gguf(path: Path) -> None:
    """A ``.gguf`` file starts with the GGUF magic bytes."""
    try:
        with path.open("rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise ProbeError(f"cannot read {path}: {exc.strerror or exc}") from None
    if magic != GGUF_MAGIC:
        raise ProbeError(f"{path} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")


def save_checkpoint(model: Any, tokenizer: Any, tmp: Path, out: Path) -> None:
    """``save_pretrained`` of ``model`` and ``tokenizer`` into ``tmp`` (a temporary directory
    that becomes ``out``); a write that fails (a full disk: an ``OSError``, or safetensors'
    ``SafetensorError`` wrapping one) is one line naming ``out`` and the cause.

    Raises:
        ProbeError: the write failed; the caller's atomic block removes ``tmp``.
    """
    from safetensors import SafetensorError

    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    except (OSError, SafetensorError) as exc:
        raise ProbeError(f"could not write the model to {out}: {write_failure(exc)}") from None


def write_failure(exc: BaseException) -> str:
    """An ``OSError``'s reason (``No space left on device``), or the first line of another
    error's text (safetensors reports a full disk as ``IoError(... StorageFull ...)``)."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = " ".join(str(exc).split())
    if "StorageFull" in text or "No space left" in text:
        return "No space left on device"
    return text[:200] or type(exc).__name__
