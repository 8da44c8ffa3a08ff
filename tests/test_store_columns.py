"""The store says what each row is: typed setting columns beside the ``setting`` string, and a
description (units, log-prob mode) on every field of the Parquet schema. Older stores, without
them, read as before."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from mismatch_probe import store
from mismatch_probe.metrics import compute_metrics
from mismatch_probe.pipeline.scan import write_tables
from mismatch_probe.pipeline.tables import with_setting_columns
from mismatch_probe.settings import RolloutSetting, Setting
from tests.test_report_fixtures import token_table, uniform_seqs

RUN = {
    "sampling": {
        "logprobs_mode": "processed",
        "rescoring": "processed",
        "rollout_logprobs": "decode (processed log-probs of the sampled tokens)",
    }
}


def matrix_tables() -> tuple[object, object]:
    import pyarrow as pa
    import pyarrow.compute as pc

    bf16 = Setting(RolloutSetting("bfloat16", "fp8"), "float32")
    fp32 = Setting(RolloutSetting("float32", lm_head_fp32=True), "float32", "rollout")
    first = with_setting_columns(token_table(uniform_seqs(0.0, [3]), fp32.name), fp32)
    second = token_table(uniform_seqs(0.1, [2, 2]), bf16.name)
    second = second.set_column(1, "seq_id", pc.add(second.column("seq_id"), 1))
    tokens = pa.concat_tables([first, with_setting_columns(second, bf16)])
    seqs = pa.table(
        {
            "setting": [fp32.name, bf16.name, bf16.name],
            "seq_id": pa.array([0, 1, 2], pa.int64()),
            "prompt_id": pa.array([0, 0, 1], pa.int64()),
            "sample_id": pa.array([0, 0, 0], pa.int32()),
            "prompt_text": ["p", "p", "q"],
            "response_text": ["a", "b", "c"],
            "prompt_length": pa.array([1, 1, 1], pa.int32()),
            "response_length": pa.array([3, 2, 2], pa.int32()),
            "finish_reason": ["stop"] * 3,
        }
    )
    settings = [fp32, bf16, bf16]
    seqs = pa.concat_tables(
        [with_setting_columns(seqs.slice(i, 1), s) for i, s in enumerate(settings)]
    )
    return tokens, seqs


def test_typed_setting_columns_filter_without_parsing(tmp_path: Path) -> None:
    tokens, seqs = matrix_tables()
    write_tables(tmp_path / "t.parquet", tmp_path / "s.parquet", tokens, seqs, RUN)  # type: ignore[arg-type]
    fp8 = pq.read_table(tmp_path / "t.parquet", filters=[("kv_cache_dtype", "=", "fp8")])
    assert set(fp8.column("setting").to_pylist()) == {"rollout=bf16,kv=fp8 | train=fp32"}
    assert fp8.num_rows == 4
    row = pq.read_table(tmp_path / "t.parquet").slice(0, 1).to_pylist()[0]
    assert {k: row[k] for k in ("rollout_dtype", "kv_cache_dtype", "quantization",
                                "lm_head_fp32", "train_dtype", "routing_replay")} == {
        "rollout_dtype": "float32", "kv_cache_dtype": "auto", "quantization": "none",
        "lm_head_fp32": True, "train_dtype": "float32", "routing_replay": "rollout",
    }  # fmt: skip
    seq = pq.read_table(tmp_path / "s.parquet", filters=[("rollout_dtype", "=", "bfloat16")])
    assert seq.column("seq_id").to_pylist() == [1, 2]


def test_fields_are_described_with_units_and_mode(tmp_path: Path) -> None:
    tokens, seqs = matrix_tables()
    write_tables(tmp_path / "t.parquet", tmp_path / "s.parquet", tokens, seqs, RUN)  # type: ignore[arg-type]
    schema = pq.read_schema(tmp_path / "t.parquet")
    described = {f.name: (f.metadata or {}).get(b"description", b"").decode() for f in schema}
    assert all(described.values()), [n for n, d in described.items() if not d]
    assert described["rollout_logprob"] == (
        "log-probability of the sampled token reported by the inference engine (natural log, "
        "nats; decode (processed log-probs of the sampled tokens))"
    )
    assert described["train_logprob"].startswith(
        "log-probability of the same token under the training forward pass (natural log, nats; "
        "processed logits)"
    )
    assert store.read_run_metadata(tmp_path / "t.parquet") == RUN  # the run metadata is kept
    seq_schema = pq.read_schema(tmp_path / "s.parquet")
    assert seq_schema.field("response_length").metadata == {
        b"description": b"response length in tokens"
    }


def test_a_store_without_them_reads_as_before(tmp_path: Path) -> None:
    old = token_table(uniform_seqs(0.1, [3, 2]), "rollout=bf16 | train=fp32")
    (tmp_path / "old").mkdir()
    path = tmp_path / "old" / store.TOKENS_FILE
    pq.write_table(old, path)  # a store written before typed columns and descriptions
    assert compute_metrics(path).scalars["num_tokens"] == 5.0
    assert store.token_schema(old.column_names) == store.TOKEN_SCHEMA
