"""``probe scan`` from the outside: bad input gives one line and exit 2; a real run's outputs.

Bad-input cases run ``cli.main`` in-process (they fail before any engine starts); one
end-to-end test runs the installed ``probe`` console script in a subprocess on the tiny model.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mismatch_probe import store
from mismatch_probe.hardware import hardware
from mismatch_probe.report.plots import PLOTS
from tests.cli_runner import run_probe_err as run_main

# What a default scan must not print (issue 11): vLLM's, Triton's and torch's import chatter.
CHATTER = ("Triton is installed", "FutureWarning", "reduce_op", "NUMA binding", "INFO", "WARNING")


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    return path


def bad_prompts(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    return path


def not_a_causal_lm(tmp_path: Path) -> Path:
    path = tmp_path / "bert"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    return path


def latin1_prompts(tmp_path: Path) -> Path:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    return path


def without_tokenizer(tmp_path: Path, model: Path) -> Path:
    """The model's config and weights (the file checks pass), no tokenizer."""
    path = tmp_path / "no_tokenizer"
    path.mkdir()
    for name in ("config.json", "model.safetensors"):
        (path / name).symlink_to(model / name)
    return path


def model_copy(tmp_path: Path, model: Path, name: str = "copy") -> Path:
    """A copy of the tiny model (its weights file to be damaged by the caller)."""
    import shutil

    return Path(shutil.copytree(model, tmp_path / name))


def truncated_weights(tmp_path: Path, model: Path) -> Path:
    path = model_copy(tmp_path, model)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return path


def random_weights(tmp_path: Path, model: Path) -> Path:
    path = model_copy(tmp_path, model)
    (path / "model.safetensors").write_bytes(random.Random(0).randbytes(4096))
    return path


def random_gguf(tmp_path: Path, model: Path) -> Path:
    path = tmp_path / "random.gguf"
    path.write_bytes(random.Random(1).randbytes(4096))
    return path


def out_is_a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a_file"
    path.write_text("x")
    return path


def existing_run(tmp_path: Path) -> Path:
    path = tmp_path / "old_run"
    path.mkdir()
    (path / store.RUN_FILE).write_text("{}")
    return path


CASES = {
    "missing model": (
        lambda tmp, model: ["--model", str(tmp / "nope")],
        "model path does not exist",
    ),
    "not a causal LM": (
        lambda tmp, model: ["--model", str(not_a_causal_lm(tmp))],
        "is not a causal language model",
    ),
    "empty prompts": (
        lambda tmp, model: ["--model", str(model), "--prompts", str(bad_prompts(tmp, "\n\n"))],
        "prompts file is empty",
    ),
    "malformed prompts": (
        lambda tmp, model: [
            "--model",
            str(model),
            "--prompts",
            str(bad_prompts(tmp, '{"prompt": "ok"}\n{"prompt": \n')),
        ],
        "bad.jsonl:2: not valid JSON",
    ),
    "prompt without text": (
        lambda tmp, model: [
            "--model",
            str(model),
            "--prompts",
            str(bad_prompts(tmp, '{"prompt": "ok"}\n\n{"text": "x"}\n')),
        ],
        "bad.jsonl:3: needs a non-empty 'prompt'",
    ),
    "negative max tokens": (
        lambda tmp, model: ["--model", str(model), "--max-tokens", "-5"],
        "--max-tokens must be >= 1",
    ),
    "unknown dtype": (
        lambda tmp, model: ["--model", str(model), "--rollout-dtype", "float8"],
        "--rollout-dtype: unknown value 'float8'",
    ),
    "prompt longer than context": (
        lambda tmp, model: [
            "--model",
            str(model),
            "--prompts",
            str(bad_prompts(tmp, json.dumps({"prompt": "fox jumps " * 400}) + "\n")),
        ],
        "exceeds the model's context of 512 tokens",
    ),
    "bad vllm arg": (
        lambda tmp, model: ["--model", str(model), "--vllm-arg", "novalue"],
        "--vllm-arg expects key=value",
    ),
    "routing replay on a dense model": (
        lambda tmp, model: ["--model", str(model), "--routing-replay", "rollout"],
        "needs a mixture-of-experts model",
    ),
    "prompts not UTF-8": (
        lambda tmp, model: ["--model", str(model), "--prompts", str(latin1_prompts(tmp))],
        "is not UTF-8 text",
    ),
    "model without tokenizer": (
        lambda tmp, model: ["--model", str(without_tokenizer(tmp, model))],
        "transformers could not load",
    ),
    "bad top-p": (
        lambda tmp, model: ["--model", str(model), "--top-p", "1.5"],
        "--top-p must be in (0, 1]",
    ),
    # issue 10: output paths, checked before any engine starts
    "--out is a file": (
        lambda tmp, model: ["--model", str(model), "--out", str(out_is_a_file(tmp))],
        "is a file, not a directory",
    ),
    "--out under a file": (
        lambda tmp, model: ["--model", str(model), "--out", str(out_is_a_file(tmp) / "run")],
        "a parent of the path is a file",
    ),
    "--out holds a run": (
        lambda tmp, model: ["--model", str(model), "--out", str(existing_run(tmp))],
        "holds a run already (run.json); choose another directory, or give --force",
    ),
    # issue 10: --vllm-arg cannot replace what probe sets, and is checked against vLLM's types
    **{
        f"--vllm-arg {key}": (
            lambda tmp, model, arg=arg: ["--model", str(model), "--vllm-arg", arg],
            expected,
        )
        for key, arg, expected in (
            ("dtype", "dtype=float32", "probe sets dtype itself; use --rollout-dtype"),
            ("logprobs_mode", "logprobs_mode=raw_logprobs", "use --logprobs-mode"),
            ("model", "model=/elsewhere", "probe sets model itself; use --model"),
            ("seed", "seed=7", "probe sets seed itself; use --seed"),
            ("max_model_len", "max_model_len=64", "probe sets max_model_len itself"),
            ("generation_config", "generation_config=auto", "use --temperature, --top-p"),
            ("kv_cache_dtype", "kv_cache_dtype=fp8", "use --kv-cache-dtype"),
            ("quantization", "quantization=fp8", "use --quantization"),
            ("hf_overrides", 'hf_overrides={"head_dtype": "float32"}', "use --lm-head-fp32"),
            (
                "max_num_seqs=abc",
                "max_num_seqs=abc",
                "--vllm-arg max_num_seqs=abc: expected an integer",
            ),
            (
                "unknown",
                "max_num_seq=4",
                "vLLM has no engine argument 'max_num_seq' (did you mean max_num_seqs?)",
            ),
            (
                "gpu_memory_utilization=NaN",
                "gpu_memory_utilization=NaN",
                "--vllm-arg gpu_memory_utilization=NaN: expected a finite number",
            ),
            (
                "enforce_eager=1",
                "enforce_eager=1",
                "--vllm-arg enforce_eager=1: expected true or false",
            ),
        )
    },
    # issue 10: weights and model files checked before an engine starts
    "truncated safetensors": (
        lambda tmp, model: ["--model", str(truncated_weights(tmp, model))],
        "model.safetensors is not a readable safetensors file",
    ),
    "random-bytes safetensors": (
        lambda tmp, model: ["--model", str(random_weights(tmp, model))],
        "model.safetensors is not a readable safetensors file",
    ),
    "glob characters in the model path": (
        lambda tmp, model: ["--model", str(model_copy(tmp, model, "tiny[ab]"))],
        "vLLM cannot load a model from a path holding [, ], * or ?",
    ),
    "random-bytes gguf": (
        lambda tmp, model: ["--model", str(random_gguf(tmp, model))],
        "random.gguf is not a GGUF file",
    ),
    # issue 10: non-finite floats and empty list elements
    "infinite temperature": (
        lambda tmp, model: ["--model", str(model), "--temperature", "inf"],
        "--temperature must be a finite number, got inf",
    ),
    "infinite flip eps": (
        lambda tmp, model: ["--model", str(model), "--flip-eps", "inf"],
        "--flip-eps must be a finite number",
    ),
    "nan top-p": (
        lambda tmp, model: ["--model", str(model), "--top-p", "nan"],
        "--top-p must be a finite number",
    ),
    "empty dtype element": (
        lambda tmp, model: ["--model", str(model), "--rollout-dtype", "bfloat16,,float32"],
        "--rollout-dtype: empty element in 'bfloat16,,float32'",
    ),
    "trailing comma": (
        lambda tmp, model: ["--model", str(model), "--train-dtype", "float32,"],
        "--train-dtype: empty element",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_exits_2_with_one_line(
    case: str,
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
) -> None:
    make_args, expected = CASES[case]
    out = tmp_path / "out"
    code, err = run_main(
        ["scan", "--out", str(out), *make_args(tmp_path, tiny_model)], monkeypatch, capsys
    )
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    assert expected in lines[0]
    assert not (out / store.TOKENS_FILE).exists()


def test_unknown_option_is_usage_error(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    code, err = run_main(["scan", "--no-such-option"], monkeypatch, capsys)
    assert code == 2
    assert "No such option" in err


@pytest.mark.engine
def test_scan_end_to_end_subprocess(tiny_model: Path, prompts_file: Path, tmp_path: Path) -> None:
    """The console script on the tiny model: fp32 both sides, processed, top-p; read back."""
    out = tmp_path / "run"
    probe = Path(sys.executable).with_name("probe")
    args = [str(probe), "scan", "--model", str(tiny_model), "--prompts", str(prompts_file)]
    args += ["--samples-per-prompt", "3", "--max-tokens", "12", "--temperature", "0.8"]
    args += ["--top-p", "0.95", "--rollout-dtype", "float32", "--out", str(out)]
    args += ["--vllm-arg", f"kv_cache_memory_bytes={64 << 20}"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # quiet by default: no import chatter of vLLM, Triton or torch, only the progress bars
    assert not [line for line in proc.stderr.splitlines() if any(c in line for c in CHATTER)]
    assert "gen rollout=fp32" in proc.stderr
    # stderr is no terminal: plain progress lines as each phase goes, no ANSI codes
    assert "\x1b" not in proc.stderr
    gen = [line for line in proc.stderr.splitlines() if line.startswith("gen rollout=fp32")]
    assert gen[0].endswith(": started, 6 responses") and ": done, 6 responses in " in gen[-1]
    score = [line for line in proc.stderr.splitlines() if line.startswith("score ")]
    assert score[0].endswith(" tokens") and ": started, " in score[0]
    assert ": done, " in score[-1] and "tokens/s)" in score[-1]
    phases = [line for line in proc.stderr.splitlines() if line.endswith(": started")]
    assert {"model_load: started", "metrics: started", "reports: started"} <= set(phases)
    assert "k3_kl" in proc.stdout and str(out / "tokens.parquet") in proc.stdout

    tokens = pq.read_table(out / store.TOKENS_FILE)
    sequences = pq.read_table(out / store.SEQUENCES_FILE)
    typed = [f.name for f in store.SETTING_FIELDS]  # the setting as typed columns
    assert tokens.schema.remove_metadata() == pa.schema(
        [*store.TOKEN_SCHEMA, store.ENTROPY_FIELD, store.TURN_FIELD, *store.SETTING_FIELDS]
    )  # the rescorer's entropy and the turn too
    assert sequences.schema.remove_metadata() == pa.schema(
        [
            *store.SEQUENCE_SCHEMA,
            *store.SEQUENCE_MISMATCH_FIELDS,
            *store.SEQUENCE_TURN_FIELDS,
            *store.SETTING_FIELDS,
        ]
    )
    # each sequence's own mismatch: the sum of its tokens' r = train - rollout, no join needed
    r = np.asarray(tokens.column("train_logprob"), np.float64) - np.asarray(
        tokens.column("rollout_logprob"), np.float64
    )
    seq_of = np.asarray(tokens.column("seq_id"))
    by_seq = {int(s): float(r[seq_of == s].sum()) for s in np.unique(seq_of)}
    stored = dict(
        zip(
            sequences.column("seq_id").to_pylist(),
            sequences.column("seq_log_ratio_sum").to_pylist(),
            strict=True,
        )
    )
    assert stored.keys() == by_seq.keys()
    assert stored == by_seq  # the same float64 sum of the same float32 log-probs
    assert all(v >= 0.0 for v in sequences.column("seq_k3_sum").to_pylist())
    assert tokens.select(typed).slice(0, 1).to_pylist() == [
        {"rollout_dtype": "float32", "kv_cache_dtype": "auto", "quantization": "none",
         "lm_head_fp32": False, "train_dtype": "float32", "routing_replay": "none"}
    ]  # fmt: skip
    assert b"nats" in tokens.schema.field("train_logprob").metadata[b"description"]
    assert set(tokens.column("turn").to_pylist()) == {0}  # single-turn prompts
    assert set(sequences.column("num_turns").to_pylist()) == {1}
    assert sequences.num_rows == 6
    lengths = sequences.column("response_length").to_pylist()
    assert tokens.num_rows == sum(lengths)
    assert all(1 <= n <= 12 for n in lengths)
    assert sorted(set(tokens.column("prompt_id").to_pylist())) == [0, 1]

    run = json.loads((out / store.RUN_FILE).read_text())
    assert run["hardware"]["compute"] == hardware()["compute"]  # what checks and compares read
    assert run["hardware"]["cpu_model"] and "cpu_flags" in run["hardware"]
    assert run["sampling"]["vllm_logprobs_mode"] == "processed_logprobs"
    assert run["sampling"]["top_p"] == 0.95
    (engine,) = run["rollouts"]
    assert engine["engine_args"]["dtype"] == "float32"
    assert engine["engine_args"]["generation_config"] == "vllm"
    assert engine["engine_args"]["logprobs_mode"] == "processed_logprobs"
    assert engine["engine_mode"] == "in-process"  # CPU, one worker: the fast start
    assert set(run["timings"]) >= {"engine_start", "generation", "rescoring", "writing"}
    assert store.read_run_metadata(out / store.TOKENS_FILE)["setting"] == run["setting"]

    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["num_tokens"] == tokens.num_rows
    assert metrics["k3_kl"] < 1e-6  # fp32 vs fp32: the identity

    # The one-file report, and the baseline gate on a real run.json (a run against itself).
    html = (out / "report.html").read_text()
    assert str(out / "report.html") in proc.stdout
    assert html.count('src="data:image/png;base64,') == len(PLOTS) and "<script" not in html
    assert len(run["prompts"]["sha256"]) == 64
    gate = [str(probe), "check", str(out), "--baseline", str(out), "--max-increase", "k3_kl=1x"]
    checked = subprocess.run(gate, capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.splitlines()[-1] == "all bounds hold"


# ``probe`` as the console script runs it, then what the process imported, on stderr's last line.
IMPORT_RECORD = """
import json, sys
from mismatch_probe import cli
sys.argv = ["probe", *sys.argv[1:]]
try:
    cli.main()
    code = 0
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in ("vllm", "transformers", "torch") if m in sys.modules)
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


@pytest.mark.parametrize("vllm_arg", [[], ["--vllm-arg", "max_num_seqs=4"]])
def test_a_bad_out_fails_before_vllm_is_imported(
    tiny_model: Path, prompts_file: Path, tmp_path: Path, vllm_arg: list[str]
) -> None:
    """``--out`` under a file fails with one line, and the process never imported vLLM,
    transformers or torch (its own ``sys.modules``): every path and option check runs first,
    a ``--vllm-arg`` included (its types are checked once vLLM is imported anyway)."""
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "run"
    args = ["scan", "--model", str(tiny_model), "--prompts", str(prompts_file), "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_RECORD, *args, *vllm_arg],
        capture_output=True,
        text=True,
        timeout=120,
    )
    *lines, record = proc.stderr.strip().splitlines()
    assert json.loads(record) == {"code": 2, "heavy": []}
    assert lines == [
        f"error: --out: cannot write to {out} (Not a directory (a parent of the path is a file))"
    ]
