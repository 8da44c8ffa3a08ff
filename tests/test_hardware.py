"""The hardware in run.json, and runs from different hardware flagged: ``probe check
--baseline`` exits 2 (unless ``--allow-different``), ``probe compare`` warns."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mismatch_probe.gate.compare import load_comparison
from mismatch_probe.hardware import KERNEL_FLAGS, compute_key, cpu_info, hardware
from tests.test_report_baseline import LENGTHS, edit_run_json
from tests.test_report_check import run_main
from tests.test_report_fixtures import uniform_run

INTEL_AMX = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16 amx_bf16 amx_tile \
hypervisor

processor\t: 1
model name\t: something else
flags\t\t: fpu
"""
AMD_AVX2 = """processor\t: 0
model name\t: AMD EPYC 7763 64-Core Processor
flags\t\t: fpu sse2 avx avx2 fma f16c
"""
ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes sve sve2 bf16 i8mm
"""


def test_cpu_model_and_kernel_flags_from_cpuinfo() -> None:
    intel = cpu_info(INTEL_AMX)
    assert intel == {
        "cpu_model": "Intel(R) Xeon(R) Platinum 8480+",  # the first processor's
        "cpu_flags": [
            "avx",
            "avx2",
            "fma",
            "f16c",
            "avx512f",
            "avx512bw",
            "avx512vl",
            "avx512_bf16",
            "amx_tile",
            "amx_bf16",
        ],
    }
    assert cpu_info(AMD_AVX2)["cpu_flags"] == ["avx", "avx2", "fma", "f16c"]
    arm = cpu_info(ARM)
    assert arm["cpu_flags"] == ["asimd", "sve", "sve2", "bf16", "i8mm"] and arm["cpu_model"]
    assert cpu_info("")["cpu_flags"] == []  # no /proc/cpuinfo (macOS): the model only


def test_compute_key_names_what_did_the_arithmetic() -> None:
    amd, intel = cpu_info(AMD_AVX2), cpu_info(INTEL_AMX)
    assert compute_key(amd, []) == "cpu avx avx2 fma f16c"
    assert compute_key(amd, []) != compute_key(intel, [])  # AVX2 vs AMX: different kernels
    same_isa = {**amd, "cpu_model": "AMD EPYC 9V74"}
    assert compute_key(same_isa, []) == compute_key(amd, [])  # same kernels, same key
    assert compute_key(amd, ["NVIDIA H100 80GB HBM3"]) == "NVIDIA H100 80GB HBM3"
    assert compute_key(amd, ["NVIDIA A10G"] * 2) == "2 x NVIDIA A10G"
    assert compute_key({"cpu_model": "arm64", "cpu_flags": []}, []) == "cpu arm64"


def test_this_machine() -> None:
    info = hardware()
    assert info["cpu_model"] and set(info["cpu_flags"]) <= set(KERNEL_FLAGS)
    assert info["compute"] == compute_key(info, info.get("gpus", []))
    assert isinstance(info["torch_cpu_capability"], str) and info["torch_cpu_capability"]
    printed = subprocess.run(
        [sys.executable, "-m", "mismatch_probe.hardware"], capture_output=True, text=True
    )
    assert printed.returncode == 0 and printed.stdout == info["compute"] + "\n"


@pytest.fixture
def two_machines(tmp_path: Path) -> tuple[Path, Path]:
    """Two runs of the same thing, on an AMX machine (head) and an AVX2 one (baseline)."""
    head = uniform_run(tmp_path / "head", 0.01, LENGTHS)
    base = uniform_run(tmp_path / "base", 0.01, LENGTHS)
    edit_run_json(head, hardware__compute=compute_key(cpu_info(INTEL_AMX), []))
    edit_run_json(base, hardware__compute=compute_key(cpu_info(AMD_AVX2), []))
    return head, base


def test_check_refuses_a_baseline_from_other_hardware(
    two_machines: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    head, base = two_machines
    args = ["check", str(head), "--baseline", str(base), "--max-increase", "k3_kl=1.5x"]
    args += ["--accept", "truncated_support"]  # a uniform run's constant log-ratio
    code, out = run_main(args, monkeypatch, capsys)
    assert code == 2
    assert out.startswith("error: the runs are not comparable: hardware differs (head: ")
    assert "amx_bf16" in out and out.rstrip().endswith("(--allow-different to gate them anyway)")
    code, out = run_main([*args, "--allow-different"], monkeypatch, capsys)
    assert code == 0 and "⚠ hardware differs" in out
    edit_run_json(base, hardware__compute=compute_key(cpu_info(INTEL_AMX), []))
    code, out = run_main(args, monkeypatch, capsys)
    assert code == 0 and "hardware" not in out


def test_compare_warns_about_other_hardware(two_machines: tuple[Path, Path]) -> None:
    head, base = two_machines
    assert load_comparison([base, head]).warnings == (
        "hardware differs (base: cpu avx avx2 fma f16c; head: …_bf16 amx_tile amx_bf16)",
    )


def test_a_run_without_the_record_is_not_refused(
    two_machines: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """A baseline scanned by an older version (no hardware.compute) is still gated."""
    head, base = two_machines
    edit_run_json(base, hardware={})
    args = ["check", str(head), "--baseline", str(base), "--max-increase", "k3_kl=1.5x"]
    args += ["--accept", "truncated_support"]  # a uniform run's constant log-ratio
    code, _ = run_main(args, monkeypatch, capsys)
    assert code == 0
