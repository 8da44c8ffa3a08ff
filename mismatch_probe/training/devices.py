"""Where the training-side model lives: one GPU, the CPU, or split across devices.

``--train-device-map`` takes ``auto`` or ``balanced`` (transformers/Accelerate big-model loading:
whole layers placed on the GPUs in turn, then the CPU, then disk, each layer's weights moved
to its execution device by a hook before it runs), ``cuda`` (one GPU) or ``cpu``. Splitting
moves activations between devices at layer boundaries but keeps every operation's math as on
one device, so the log-probabilities stay those of the same kernels on the same dtypes.

Without the option, ``default_device_map`` decides from the visible GPUs' free memory and the
model's weight bytes: ``cpu`` without a GPU, ``auto`` when several GPUs are visible or the model
does not fit one, ``cuda`` otherwise.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEVICE_MAPS = ("auto", "balanced", "cuda", "cpu")
FIT_SHARE = 0.8  # weights may take this share of a GPU's free memory (rest: activations, logits)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I8": 1}


def default_device_map(gpu_free_bytes: Sequence[int], model_bytes: int) -> str:
    """The device map when none is asked for.

    Args:
        gpu_free_bytes: free memory of each visible GPU (empty: no GPU).
        model_bytes: the model's weights in the training dtype.

    Returns:
        ``"cpu"`` without a GPU; ``"auto"`` with several GPUs or when the weights exceed
        ``FIT_SHARE`` of the one GPU's free memory; else ``"cuda"``.
    """
    if not gpu_free_bytes:
        return "cpu"
    if len(gpu_free_bytes) > 1 or model_bytes > FIT_SHARE * gpu_free_bytes[0]:
        return "auto"
    return "cuda"


def visible_gpu_free_bytes() -> list[int]:
    """Free memory of each visible CUDA device (``[]`` without one)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [int(torch.cuda.mem_get_info(i)[0]) for i in range(torch.cuda.device_count())]


def check_available(choice: str | None) -> None:
    """Fail with one line when ``choice`` needs a CUDA device this machine does not have
    (checked before any engine starts: the training side loads only after the whole rollout).

    Raises:
        ProbeError: ``cuda`` without a visible CUDA device.
    """
    if choice != "cuda":
        return  # auto and balanced place what fits, the CPU included
    import torch

    if not torch.cuda.is_available():
        from mismatch_probe.errors import ProbeError

        raise ProbeError(
            "--train-device-map cuda: no CUDA device is visible on this machine; use cpu, "
            "auto, or leave the option out"
        )


def parameter_count(model_dir: Path) -> int | None:
    """Parameters in the checkpoint's safetensors files (read from their headers), or None."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for dim in entry["shape"]:
                    count *= int(dim)
                total += count
    return total


def model_bytes(model_dir: Path, dtype: str) -> int:
    """The weights' bytes in ``dtype`` (the checkpoint files' size when no header is readable)."""
    count = parameter_count(model_dir)
    if count is not None:
        return count * DTYPE_BYTES[dtype]
    return sum(p.stat().st_size for p in model_dir.glob("*.bin"))


def resolve(choice: str | None, model_dir: Path, dtype: str) -> str:
    """``choice``, or ``default_device_map`` of this machine when None."""
    if choice is not None:
        return choice
    return default_device_map(visible_gpu_free_bytes(), model_bytes(model_dir, dtype))


def load_kwargs(
    device_map: str, max_memory: dict[Any, Any] | None = None, offload_folder: Path | None = None
) -> dict[str, Any]:
    """``from_pretrained`` arguments of a device map (``cpu``: a plain load, no hooks)."""
    if device_map == "cpu":
        return {"device_map": None}
    kwargs: dict[str, Any] = {"device_map": device_map}
    if max_memory is not None:
        kwargs["max_memory"] = max_memory
    if offload_folder is not None:
        kwargs["offload_folder"] = str(offload_folder)
    return kwargs


def input_device(model: Any) -> Any:
    """The device the input ids go to: the embedding's execution device (``hf_device_map``'s
    first entry for a split model; a disk-offloaded layer executes on the CPU)."""
    import torch

    placement = getattr(model, "hf_device_map", None)
    if placement:
        first = next(iter(placement.values()))
        if isinstance(first, int):
            return torch.device("cuda", first)
        return torch.device("cpu" if first == "disk" else first)
    return next(model.parameters()).device


def describe(model: Any, requested: str | None, used: str) -> dict[str, Any]:
    """What run.json records: the option (None: default), the map used, where modules went."""
    placement = getattr(model, "hf_device_map", None)
    if placement:
        where = {name: str(device) for name, device in placement.items()}
    else:
        where = {"": str(next(model.parameters()).device)}
    devices = sorted(set(where.values()))
    return {"requested": requested, "used": used, "devices": devices, "modules": where}
