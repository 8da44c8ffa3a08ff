"""``probe refit``: B pushed into an engine running A (the real vLLM CPU engine, tiny models
built here, B = A after a real optimizer step), the weight audit, the links, ``probe check``.

Engines are the cost: the clean refit runs once (two engines), the wrong refit reuses its fresh
side (one more), the tied model runs once (two), the refused method stops at its first engine;
the multiprocess refit and the precision list reuse the clean run's fresh side; the interrupted
``probe refit`` runs in its own process (a multiprocess engine), watched by a thread.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mismatch_probe.engine import refit
from mismatch_probe.gate.refit import gate_refit
from mismatch_probe.pipeline.refit import (
    RefitConfig,
    RefitResult,
    perturbed_refit_caught,
    run_refit,
)
from tests.bench.refit import checkpoint_pair
from tests.cli_runner import run_probe
from tests.tolerances import ulp_bound

# Longer than one 128-token cache block in the tiny tokenizer (whole blocks are cached).
SYSTEM = (
    "You are the policy of a reinforcement learning run. Answer the task in plain text, "
    "think step by step, and end with one line that starts with Answer: and the value. "
    "The checker compares that line with the reference answer."
)
TASKS = ("What is the capital of France?", "Solve for x: 3x + 5 = 20.", "def add(a, b):")
ENGINE_ARGS = {"kv_cache_memory_bytes": 128 << 20}


def _pair(root: Path, tied: bool, arch: str = "llama") -> tuple[Path, Path]:
    """A tiny checkpoint A and B = A after one AdamW step (the bench's pair)."""
    return checkpoint_pair(root, tied, arch)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("refit-prompts") / "long.jsonl"
    lines = [
        {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": t}]}
        for t in TASKS
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _config(a: Path, b: Path, out: Path, prompts: Path) -> RefitConfig:
    return RefitConfig(a, b, out, prompts=prompts, max_tokens=16, vllm_args=ENGINE_ARGS)


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _pair(tmp_path_factory.mktemp("untied"), tied=False)


@pytest.fixture(scope="module")
def clean(
    untied: tuple[Path, Path], prompts: Path, tmp_path_factory: pytest.TempPathFactory
) -> RefitResult:
    out = tmp_path_factory.mktemp("clean-run")
    return run_refit(_config(*untied, out, prompts), None)


def test_clean_refit_audit_and_links(clean: RefitResult) -> None:
    data = clean.data
    audit = data["audit"]
    assert (audit["mismatched"], audit["missing"], audit["unexpected"]) == ([], [], [])
    assert all(row["equal"] and row["max_abs_diff"] == 0.0 for row in audit["tensors"])
    assert any(".qkv_proj." in row["name"] for row in audit["tensors"])  # read back, fused
    assert audit["checkpoint_tensors_checked"] > 0
    control = audit["negative_control"]
    assert control["named"] and not audit["broken"]
    assert control["engine_tensor"].endswith(("qkv_proj.weight", "gate_up_proj.weight"))
    links = data["links"]
    assert links["refit"]["tokens"] > 0
    assert links["refit"]["k3_kl"] == 0.0 and links["refit"]["max_abs"] == 0.0  # fp32: exact
    assert links["cache_salt"]["k3_kl"] == 0.0 and links["cache_salt"]["tokens"] > 0
    # The worker's reload does not touch the scheduler's prefix cache: KV computed with A read.
    warm = data["cache"]["warm_cached_tokens"]
    assert min(warm) >= data["cache"]["block_size"] > 0
    assert links["stale_prefix_cache"]["k3_kl"] > 0.0
    # only positions after the cached prefix are scored
    first = min(p["position"] for p in links["stale_prefix_cache"]["positions"])
    assert first > min(warm)
    train = links["engine_vs_train"]
    assert train["tokens"] == links["refit"]["tokens"]
    assert train["max_abs"] <= ulp_bound(np.array([20.0]))
    # a reload refit leaves the cache warm: probe check fails on that link alone
    assert [f.split(":")[0] for f in gate_refit(data).failures] == ["link stale_prefix_cache"]
    assert json.loads(clean.path.read_text())["links"]["refit"]["k3_kl"] == 0.0


def _wrong_push(llm: Any, path: Path) -> None:
    """q and k rows swapped inside layer 0's fused tensor; layer 1's o_proj from layer 0."""
    tensors = dict(refit.iter_checkpoint(path))
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    q_rows, k_rows = tensors[q].clone(), tensors[k].clone()
    rows = k_rows.shape[0]
    tensors[q] = torch_cat(k_rows, q_rows[rows:])
    tensors[k] = q_rows[:rows].clone()
    o0, o1 = "model.layers.0.self_attn.o_proj.weight", "model.layers.1.self_attn.o_proj.weight"
    tensors[o1] = tensors[o0].clone()
    refit.push_tensors(llm, tensors.items())


def torch_cat(*parts: Any) -> Any:
    import torch

    return torch.cat(parts)


def test_wrong_refit_named_and_link_large(
    clean: RefitResult, untied: tuple[Path, Path], prompts: Path, tmp_path: Path
) -> None:
    result = run_refit(_config(*untied, tmp_path, prompts), None, _wrong_push, clean.fresh)
    audit = result.data["audit"]
    for name in (
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.1.self_attn.o_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
    ):
        assert name in audit["mismatched"]
    assert "model.layers.0.self_attn.v_proj.weight" not in audit["mismatched"]
    assert result.data["links"]["refit"]["k3_kl"] > 1e-4
    verdict = gate_refit(result.data)
    assert not verdict.passed and any("mismatched" in f for f in verdict.failures)


def test_perturbed_refit_caught(
    clean: RefitResult, untied: tuple[Path, Path], prompts: Path, tmp_path: Path
) -> None:
    """The selftest row: one tensor of B perturbed in the refit itself is named by the audit."""
    caught, name = perturbed_refit_caught(_config(*untied, tmp_path, prompts), clean.fresh)
    assert caught and name.endswith("_proj.weight")


def test_sleep_wake_clears_the_cache(
    clean: RefitResult, untied: tuple[Path, Path], prompts: Path, tmp_path: Path
) -> None:
    """sleep-wake on the CPU backend: the worker's sleep is a no-op, but the engine core's sleep
    (level 1) pauses the scheduler with its prefix cache cleared: nothing stale is read."""
    cfg = replace(_config(*untied, tmp_path, prompts), method="sleep-wake")
    data = run_refit(cfg, None, fresh=clean.fresh).data
    assert data["method"] == "sleep-wake" and data["audit"]["mismatched"] == []
    assert data["links"]["stale_prefix_cache"]["k3_kl"] == 0.0
    assert data["links"]["refit"]["k3_kl"] == 0.0
    assert gate_refit(data).passed


def test_check_cli(
    clean: RefitResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    code, out, _ = run_probe(["check", str(clean.path.parent)], monkeypatch, capsys)
    assert code == 1 and "stale_prefix_cache" in out and "audit" not in out
    broken = json.loads(clean.path.read_text())
    broken["links"]["stale_prefix_cache"]["k3_kl"] = 0.0
    (tmp_path / "refit.json").write_text(json.dumps(broken))
    code, out, _ = run_probe(["check", str(tmp_path)], monkeypatch, capsys)
    assert code == 0 and "refit check passed" in out
    broken["audit"]["negative_control"]["named"] = False
    broken["audit"]["broken"] = True
    broken["links"]["stale_prefix_cache"]["k3_kl"] = 2e-6
    (tmp_path / "refit.json").write_text(json.dumps(broken))
    code, out, _ = run_probe(["check", str(tmp_path)], monkeypatch, capsys)
    assert code == 1 and "audit broken" in out and "stale_prefix_cache" in out
    code, out, _ = run_probe(["check", str(tmp_path), "--max-link", "1e-5"], monkeypatch, capsys)
    assert code == 1 and "stale_prefix_cache" not in out


def test_tied_head_after_reload(prompts: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """vLLM 0.32's CPU backend: reload_weights re-packs the embedding, but the tied LM head
    keeps the handle packed from A's weights; the audit names it and the refit link shows it."""
    a, b = _pair(tmp_path_factory.mktemp("tied"), tied=True)
    data = run_refit(_config(a, b, tmp_path_factory.mktemp("tied-run"), prompts), None).data
    assert data["audit"]["mismatched"] == ["lm_head.weight"]
    assert data["audit"]["negative_control"]["named"]
    assert data["links"]["refit"]["k3_kl"] > 0.0


def test_load_weights_refused(
    untied: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    from mismatch_probe.engine.process import descendants

    before = set(descendants())
    a, b = untied
    out = tmp_path / "run"
    args = ["refit", "--from", str(a), "--to", str(b), "--out", str(out)]
    code, _, err = run_probe([*args, "--method", "load-weights"], monkeypatch, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "packs the linear layers" in err and "--method reload" in err
    assert not (out / "refit.json").exists()
    assert _new_processes(before) == []


def test_report_and_comment(
    clean: RefitResult, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    run = clean.path.parent
    assert "## Refit" in (run / "report.md").read_text()
    code, out, _ = run_probe(["report", str(run), "--format", "pr-comment"], monkeypatch, capsys)
    assert code == 0 and out.startswith("### probe refit: failed")
    assert "- link stale\\_prefix\\_cache" in out and "| refit |" in out  # Markdown-escaped
    assert str(run) not in out  # no path of this machine
    code, out, _ = run_probe(["report", str(run)], monkeypatch, capsys)
    assert code == 0 and "weight audit" in out and "engine_vs_train" in out


def test_moe_experts_after_reload(prompts: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A tiny Qwen3-MoE: the fused experts (prepacked by the CPU backend) are read back through
    the inverse of the prepack and placed by the experts' own loader mapping, so the fresh
    engine on B holds every per-expert checkpoint tensor exactly. vLLM 0.32's CPU backend after
    reload_weights: ``_setup_kernel`` copies the loaded values in on a weight update but does not
    re-run the experts' prepack, so the engine stores B's experts unpacked while its kernel
    reads them as prepacked: the audit names every expert tensor (per checkpoint tensor) as
    mismatched and as not repacked, and the refit link is large."""
    a, b = _pair(tmp_path_factory.mktemp("moe"), tied=False, arch="qwen3_moe")
    data = run_refit(_config(a, b, tmp_path_factory.mktemp("moe-run"), prompts), None).data
    audit = data["audit"]
    assert (
        audit["not_compared_to_checkpoint"] == [] and audit["fresh_vs_checkpoint_mismatched"] == []
    )
    assert audit["negative_control"]["named"] and not audit["broken"]
    assert ".experts." not in audit["negative_control"]["tensor"]
    experts = [n for n in audit["mismatched"] if ".experts." in n]
    engine = {n for n in experts if n.endswith(("w13_weight", "w2_weight"))}
    per_tensor = sorted(set(experts) - engine)
    assert engine and all(".mlp.experts." in n for n in engine)
    projections = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
    assert {n.rsplit(".", 2)[-2] + ".weight" for n in per_tensor} == set(projections)
    assert len(per_tensor) == 2 * 8 * 3  # 2 layers, 8 experts, 3 projections: every one named
    assert audit["experts_not_repacked"] == per_tensor  # B's values, unpacked
    assert not [n for n in audit["mismatched"] if ".experts." not in n]
    assert any(".gate." in row["name"] for row in audit["tensors"])  # the router, read back
    assert data["links"]["refit"]["k3_kl"] > 1e-3


MULTIPROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
# Helpers of this process that outlive an engine by design (Python's multiprocessing resource
# tracker, started once for the process): not engine processes.
HELPERS = ("resource_tracker",)
BACKGROUND: set[int] = set()  # this module's own probe processes running beside its tests


def _new_processes(before: set[int]) -> list[str]:
    """The processes below this one started since ``before`` (their command lines), helpers
    left out."""
    import psutil

    from mismatch_probe.engine.process import descendants

    found = []
    for pid in set(descendants()) - before:
        try:
            proc = psutil.Process(pid)
            line = " ".join(proc.cmdline()) or proc.name()
            mine = {pid, *(p.pid for p in proc.parents())} & BACKGROUND
        except psutil.Error:
            continue
        if not mine and not any(h in line for h in HELPERS):
            found.append(line)
    return found


def test_multiprocess_refit(
    clean: RefitResult,
    untied: tuple[Path, Path],
    prompts: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The refit in vLLM's multiprocess engine (engine core and worker in their own
    processes): reload by path through ``collective_rpc``, the read-back and the layout sent as
    functions (``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` for that engine's life), the tensors back
    through msgpack; the same audit and links as in process. The fresh side is the in-process
    run's (same setting, same sampled tokens), so one multiprocess engine starts."""
    from mismatch_probe.engine.process import descendants

    before = set(descendants())
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    data = run_refit(_config(*untied, tmp_path, prompts), None, fresh=clean.fresh).data
    assert data["engine_mode"] == "multiprocess"
    audit = data["audit"]
    assert (audit["mismatched"], audit["missing"], audit["unexpected"]) == ([], [], [])
    assert audit["negative_control"]["named"] and not audit["broken"]
    assert {r["name"] for r in audit["tensors"]} == {
        r["name"] for r in clean.data["audit"]["tensors"]
    }
    assert data["links"]["refit"]["k3_kl"] == 0.0 and data["links"]["refit"]["tokens"] > 0
    assert min(data["cache"]["warm_cached_tokens"]) >= data["cache"]["block_size"]
    assert data["links"]["stale_prefix_cache"]["k3_kl"] > 0.0
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in __import__("os").environ  # restored
    assert _new_processes(before) == []  # the engine core and its worker are gone


def test_multiprocess_refuses_an_iterator(
    untied: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """An iterator of tensors cannot cross the process boundary: ``--method load-weights`` on
    a multiprocess engine is refused in one line before any engine starts; bad precision
    lists likewise."""
    from mismatch_probe.engine.process import descendants

    before = set(descendants())
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    a, b = untied
    out = tmp_path / "run"
    args = ["refit", "--from", str(a), "--to", str(b), "--out", str(out)]
    code, _, err = run_probe([*args, "--method", "load-weights"], monkeypatch, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "multiprocess" in err and "process boundary" in err and "--method reload" in err
    code, _, err = run_probe([*args, "--rollout-dtype", "float32,float64"], monkeypatch, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "float64" in err, err
    assert not out.exists() or not any(out.iterdir())
    assert _new_processes(before) == []


class Injected(RuntimeError):
    """The failure injected into a refit."""


def _failing_push(llm: Any, path: Path) -> None:
    """The real reload, then a failure (as a framework's refit that dies half-way)."""
    refit.push(llm, refit.RELOAD, path)
    raise Injected("refit failed half-way")


def test_failed_refit_leaves_no_engine(
    untied: tuple[Path, Path], prompts: Path, tmp_path: Path
) -> None:
    """An exception in the middle of the refit (after the reload): it reaches the caller, the
    in-process engine is shut down (vLLM's parallel groups gone, no process left), and the run
    directory holds nothing."""
    from vllm.distributed import parallel_state

    from mismatch_probe.engine.process import descendants

    before = set(descendants())
    out = tmp_path / "run"
    with pytest.raises(Injected):
        run_refit(_config(*untied, out, prompts), None, _failing_push)
    assert not parallel_state.model_parallel_is_initialized()
    assert _new_processes(before) == []
    assert not out.exists() or not any(out.iterdir())


@dataclass
class Interrupted:
    """``probe refit`` in a process of its own, interrupted: what it left."""

    code: int | None
    stderr: str
    signalled: bool
    seen: dict[int, str]  # every process below it while it ran: pid -> start time
    out: Path


class Background:
    """``probe refit`` started in a process of its own (multiprocess engine), watched by a
    thread: SIGINT to its process group once it enters the refit stage (held open)."""

    def __init__(self, a: Path, b: Path, prompts: Path, root: Path) -> None:
        import os
        import subprocess
        import sys
        import threading

        self.out, self.trace, self.stderr = root / "run", root / "stages.txt", root / "err.txt"
        env = {**os.environ, **MULTIPROCESS, "MISMATCH_PROBE_STAGE_TRACE": str(self.trace),
               "MISMATCH_PROBE_STAGE_HOLD": "refit"}  # fmt: skip
        kv = f"kv_cache_memory_bytes={128 << 20}"
        args = ["refit", "--from", str(a), "--to", str(b), "--out", str(self.out), "--prompts",
                str(prompts), "--max-tokens", "8", "--vllm-arg", kv]  # fmt: skip
        probe = Path(sys.executable).with_name("probe")
        with open(self.stderr, "w") as stderr:
            self.proc = subprocess.Popen(
                [str(probe), *args],
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env=env,
                start_new_session=True,
            )
        BACKGROUND.add(self.proc.pid)
        self.seen: dict[int, str] = {}
        self.signalled = False
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        import os
        import signal
        import time

        from mismatch_probe.engine.process import descendants
        from tests.test_lifecycle import _start_time

        deadline = time.monotonic() + 600
        while self.proc.poll() is None and time.monotonic() < deadline:
            for child in descendants(self.proc.pid):
                start = _start_time(child)
                if start is not None:
                    self.seen.setdefault(child, start)
            stages = self.trace.read_text().split("\n")[:-1] if self.trace.exists() else []
            if not self.signalled and stages and stages[-1] == "refit":
                os.killpg(self.proc.pid, signal.SIGINT)
                self.signalled = True
            time.sleep(0.1)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def result(self) -> Interrupted:
        self.thread.join()
        code = self.proc.returncode
        return Interrupted(code, self.stderr.read_text(), self.signalled, self.seen, self.out)


@pytest.fixture(scope="module")
def interrupted(
    untied: tuple[Path, Path], prompts: Path, tmp_path_factory: pytest.TempPathFactory
) -> Background:
    """Started when its test runs, with no other engine of this module alive (started beside
    the clean run's in-process engines, its worker failed to start on this machine)."""
    return Background(*untied, prompts, tmp_path_factory.mktemp("interrupted"))


def test_interrupted_multiprocess_refit_leaves_no_engine(interrupted: Background) -> None:
    """``probe refit`` in a process of its own with a multiprocess engine, SIGINT while the
    refit runs (the stage held open): one line, exit 130, no engine process left, nothing in
    the run directory."""
    from tests.test_lifecycle import survivors

    result = interrupted.result()
    err = result.stderr
    assert result.signalled and result.code == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == "interrupted during refit; nothing written", err[-3000:]
    assert "Traceback" not in err
    assert len(result.seen) >= 2 and survivors(result.seen) == []  # engine core, worker: gone
    assert not result.out.exists() or not any(result.out.iterdir())


def test_precision_lists_one_result_per_setting(
    clean: RefitResult,
    untied: tuple[Path, Path],
    prompts: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
) -> None:
    """``--rollout-dtype float32,bfloat16 --train-dtype float32,bfloat16``: each rollout
    setting runs its own engines (float32 reuses the clean run's fresh side), each training
    dtype its own forward: four results, each audited and gated under its name. The refit is
    exact in bfloat16 too (the same processing of the same values)."""
    cfg = replace(_config(*untied, tmp_path, prompts), rollout_dtype="float32,bfloat16",
                  train_dtype="float32,bfloat16")  # fmt: skip
    result = run_refit(cfg, None, fresh=clean.fresh)
    parts = result.data["settings"]
    names = [p["setting"] for p in parts]
    assert names == [f"rollout={r} | train={t}" for r in ("fp32", "bf16") for t in ("fp32", "bf16")]
    for part in parts:
        assert part["audit"]["mismatched"] == [] and part["audit"]["negative_control"]["named"]
        assert part["links"]["refit"]["k3_kl"] == 0.0 and part["links"]["refit"]["tokens"] > 0
        assert part["links"]["stale_prefix_cache"]["k3_kl"] > 0.0
    bf16 = [p for p in parts if p["rollout_dtype"] == "bfloat16"]
    assert {p["audit"]["tensors"][0]["dtype"] for p in bf16} == {"bfloat16"}
    # the training dtype changes only the engine_vs_train link of a rollout setting
    assert parts[0]["links"]["refit"] == parts[1]["links"]["refit"]
    assert parts[0]["links"]["engine_vs_train"] != parts[1]["links"]["engine_vs_train"]
    code, out, _ = run_probe(["check", str(tmp_path)], monkeypatch, capsys)
    assert code == 1
    for name in names:
        assert f"[{name}] link stale_prefix_cache" in out
    report = (tmp_path / "report.md").read_text()
    assert report.count("## Refit: ") == 4


def test_report_html(clean: RefitResult, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """report.html: the refit section as one self-contained page, the same as report.md's
    (rendered from the view rundir reads), written by the run and again by probe report."""
    from mismatch_probe.report.refit import refit_html
    from mismatch_probe.rundir.refit import read_refit

    run = clean.path.parent
    page = (run / "report.html").read_text()
    assert page == refit_html(read_refit(run))
    assert "<h2>Refit</h2>" in page and "Content-Security-Policy" in page
    for name in ("stale_prefix_cache", "refit", "engine_vs_train", "cache_salt"):
        assert f"<td>{name}</td>" in page
    assert "<script" not in page and str(run) not in page
    (run / "report.html").unlink()
    code, out, _ = run_probe(["report", str(run)], monkeypatch, capsys)
    assert code == 0 and (run / "report.html").read_text() == page and "report.html" in out
