"""``probe scan`` options -> ``ScanConfig``, value by value, without starting an engine.

The CLI takes its defaults and validation from the config dataclasses: with no option the
config equals ``ScanConfig()``, and every option lands in its field. ``run_scan`` is replaced by
a recorder (a unit test of the thin layer; the end-to-end scan is in ``test_scan_cli.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from mismatch_probe import cli
from mismatch_probe.metrics import MetricsConfig
from mismatch_probe.options import METRIC_OPTIONS
from mismatch_probe.pipeline import scan, sharding
from mismatch_probe.pipeline.config import ScanConfig
from mismatch_probe.sampling import SamplingSpec


class Recorded(Exception):
    """Raised by the recorder so the command stops before rendering."""


def scan_config(args: list[str], monkeypatch: pytest.MonkeyPatch) -> ScanConfig:
    seen: list[ScanConfig] = []

    def record(cfg: ScanConfig, console: Any) -> None:
        seen.append(cfg)
        raise Recorded

    monkeypatch.setattr(scan, "run_scan", record)
    monkeypatch.setattr(sharding, "run_sharded", record)
    monkeypatch.setattr(sys, "argv", ["probe", "scan", *args])
    with pytest.raises(Recorded):
        cli.main()
    return seen[0]


def test_no_option_gives_the_library_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    assert scan_config([], monkeypatch) == ScanConfig()
    assert ScanConfig().sampling == SamplingSpec()  # one default max_tokens for both


def test_every_option_lands_in_its_field(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    args = [
        "--model", str(tmp_path / "m"), "--prompts", str(tmp_path / "p.jsonl"),
        "--num-prompts", "5", "--samples-per-prompt", "2", "--max-tokens", "17",
        "--temperature", "0.7", "--top-p", "0.9", "--top-k", "20", "--seed", "3",
        "--logprobs-mode", "raw", "--rollout-dtype", "bfloat16,float16",
        "--train-dtype", "float32,bfloat16", "--kv-cache-dtype", "auto,fp8",
        "--quantization", "none", "--lm-head-fp32", "off,on", "--routing-replay", "none",
        "--same-tokens", "--strict", "--no-chat", "--out", str(tmp_path / "out"),
        "--vllm-arg", "max_num_seqs=4", "--vllm-arg", "enforce_eager=true",
        "--batch-tokens", "512", "--flip-eps", "0.001",
    ]  # fmt: skip
    cfg = scan_config(args, monkeypatch)
    assert cfg.model == tmp_path / "m"
    assert cfg.prompts == tmp_path / "p.jsonl"
    assert cfg.num_prompts == 5
    assert cfg.samples_per_prompt == 2
    assert cfg.sampling == SamplingSpec(
        temperature=0.7, top_p=0.9, top_k=20, max_tokens=17, seed=3, logprobs_mode="raw"
    )
    assert cfg.rollout_dtypes == ("bfloat16", "float16")
    assert cfg.train_dtypes == ("float32", "bfloat16")
    assert cfg.kv_cache_dtypes == ("auto", "fp8")
    assert cfg.quantizations == ("none",)
    assert cfg.lm_head_fp32 == (False, True)
    assert cfg.routing_replay == ("none",)
    assert (cfg.same_tokens, cfg.strict, cfg.chat) == (True, True, False)
    assert cfg.out == tmp_path / "out"
    assert cfg.vllm_args == {"max_num_seqs": 4, "enforce_eager": True}
    assert (cfg.batch_tokens, cfg.flip_eps) == (512, 0.001)


def test_the_metric_options_are_one_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """``probe metrics`` and ``probe report`` take the same options, built into one config."""
    seen: list[MetricsConfig] = []
    monkeypatch.setattr(
        "mismatch_probe.rundir.load_report", lambda run_dir, cfg, **_: seen.append(cfg) or 1 / 0
    )
    monkeypatch.setattr("mismatch_probe.metrics.compute_metrics", lambda p, cfg, setting: 1 / 0)
    args = ["--rollout-is", "sequence", "--rollout-is-threshold", "0.5_5.0", "--rollout-rs",
            "token_k1", "--rollout-rs-threshold", "0.5_2.0", "--batch-normalize",
            "--preset", "token_is", "--preset", "k3_rs"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["probe", "report", "run", *args])
    with pytest.raises(ZeroDivisionError):
        cli.main()
    assert seen == [
        MetricsConfig(
            rollout_is="sequence",
            rollout_is_threshold="0.5_5.0",
            rollout_rs="token_k1",
            rollout_rs_threshold="0.5_2.0",
            batch_normalize=True,
            presets=("token_is", "k3_rs"),
        )
    ]
    commands = cli.typer.main.get_command(cli.app).commands  # type: ignore[attr-defined]
    block = {name for name, _ in METRIC_OPTIONS}
    for name in ("metrics", "report"):
        assert block <= {p.name for p in commands[name].params}


def test_a_bare_ray_flag_means_a_local_instance(monkeypatch: pytest.MonkeyPatch) -> None:
    assert scan_config(["--shards", "2", "--ray"], monkeypatch).ray == "local"
    assert scan_config(["--ray", "--shards", "2"], monkeypatch).ray == "local"
    assert scan_config(["--shards", "2", "--ray", "auto"], monkeypatch).ray == "auto"


def test_one_function_turns_options_into_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ScanConfig.from_options`` is what the command calls: the same config from the same
    options, ``--attribute`` defaulting the log-probability mode to raw, ``VLLM_BATCH_INVARIANT``
    taken out of the engine arguments, a malformed list refused by name."""
    from mismatch_probe.errors import ProbeError

    args = ["--attribute", "--rollout-dtype", "float32,bfloat16", "--lm-head-fp32", "on"]
    args += ["--vllm-arg", "max_num_seqs=4"]
    options = {
        "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": SamplingSpec().max_tokens,
        "seed": 0,
        "logprobs_mode": None, "vllm_arg": ["max_num_seqs=4"], "rollout_dtype": "float32,bfloat16",
        "train_dtype": "float32", "kv_cache_dtype": "auto", "quantization": "none",
        "lm_head_fp32": "on", "routing_replay": "none", "attribute": True,
    }  # fmt: skip
    cfg = ScanConfig.from_options(**options)
    assert cfg == scan_config(args, monkeypatch)
    assert cfg.sampling.logprobs_mode == "raw"
    assert (cfg.rollout_dtypes, cfg.lm_head_fp32) == (("float32", "bfloat16"), (True,))
    invariant = ScanConfig.from_options(
        **{**options, "vllm_arg": ["VLLM_BATCH_INVARIANT=1", "max_num_seqs=4"]}
    )
    assert invariant.vllm_args == {"max_num_seqs": 4} and invariant.batch_invariant
    with pytest.raises(ProbeError, match="--train-dtype: empty element"):
        ScanConfig.from_options(**{**options, "train_dtype": "float32,"})
