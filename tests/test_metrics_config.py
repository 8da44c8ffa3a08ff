"""Threshold and option parsing: what each spec means, and one-line errors naming the bad part."""

from __future__ import annotations

import math

import pytest

from mismatch_probe.errors import ProbeError
from mismatch_probe.metrics import PRESETS, RS_OPTIONS, MetricsConfig
from mismatch_probe.metrics.config import RS_AGGREGATIONS, RS_ESTIMATORS, parse_is, parse_rs
from mismatch_probe.metrics.rejection import AGGREGATIONS, ESTIMATORS
from mismatch_probe.metrics.weights import RAW_WEIGHTS


def test_is_specs() -> None:
    tis = parse_is("token", "2.0")
    assert tis is not None and (tis.upper, tis.lower, tis.low, tis.icepop) == (
        2.0,
        None,
        0.5,
        False,
    )
    ice = parse_is("sequence", "0.5_5.0")
    assert ice is not None and (ice.lower, ice.upper, ice.icepop) == (0.5, 5.0, True)
    assert parse_is("token", 3) == parse_is("token", "3")  # a number means "C"
    assert parse_is(None, "2.0") is None and parse_is("none", "2.0") is None


def test_rs_specs_in_statistic_space() -> None:
    k1, k3, k2 = parse_rs("seq_sum_k1, seq_mean_k3,seq_max_k2,", "0.5_2.0, 0.01 ,3")
    assert (k1.aggregation, k1.estimator) == ("seq_sum", "k1")
    assert (k1.lo, k1.hi) == (math.log(0.5), math.log(2.0))
    assert (k3.lo, k3.hi) == (None, 0.01) and (k2.lo, k2.hi) == (None, 3.0)
    (single,) = parse_rs("token_k1", "4")  # X means [1/X, X]
    assert (single.lo, single.hi) == (math.log(0.25), math.log(4.0))
    shared = parse_rs("token_k2,token_k3", "0.5")
    assert [s.hi for s in shared] == [0.5, 0.5]
    assert [s.option for s in parse_rs("token_k2,token_k2", "1")] == ["token_k2"]


def test_option_tables_match_the_option_names() -> None:
    assert set(AGGREGATIONS) == set(RS_AGGREGATIONS) and set(ESTIMATORS) == set(RS_ESTIMATORS)
    assert set(RAW_WEIGHTS) == {"token", "sequence"}
    assert len(RS_OPTIONS) == 11 and "seq_max_k1" not in RS_OPTIONS


def test_default_config_and_presets() -> None:
    cfg = MetricsConfig()
    assert cfg.is_spec is not None and cfg.is_spec.describe() == "token TIS 2"
    assert cfg.rs_specs == () and cfg.presets == tuple(PRESETS)
    assert {"token_is", "seq_is", "token_icepop", "seq_is_rs", "geo_rs", "k3_rs"} <= set(PRESETS)
    described = cfg.describe()["presets"]
    assert described["seq_is_rs"] == "sequence TIS 2 + seq_sum_k1 0.5_2.0"
    assert described["geo_rs"] == "seq_mean_k1 0.999_1.001"
    assert described["token_icepop"] == "token IcePop [0.5, 5]"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rollout_is_threshold": "2_0.5"}, "rollout_is_threshold '2_0.5': lower bound 2 is above"),
        ({"rollout_is_threshold": "abc"}, "'abc' is not a number"),
        ({"rollout_is_threshold": "0"}, "bound 0 must be a finite number > 0"),
        ({"rollout_is_threshold": "-1"}, "bound -1 must be a finite number > 0"),
        ({"rollout_is_threshold": ""}, "rollout_is_threshold is empty"),
        ({"rollout_is_threshold": True}, "expected a number or a string"),
        ({"rollout_is_threshold": "nan"}, "bound nan must be a finite number"),
        ({"rollout_is_threshold": "1_2_3"}, "expected one number or L_U"),
        ({"rollout_is": "tokens"}, "rollout_is 'tokens': expected token, sequence or none"),
        (
            {"rollout_rs": "token_k1,seq_sum_k2,seq_max_k3", "rollout_rs_threshold": "1,2"},
            "2 thresholds for 3 options (token_k1, seq_sum_k2, seq_max_k3); give 1 or 3",
        ),
        (
            {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": "_"},
            "'_' for seq_mean_k3: a k2/k3 option takes one number U",
        ),
        (
            {"rollout_rs": "token_k2", "rollout_rs_threshold": "0.1_0.2"},
            "for token_k2: a k2/k3 option takes one number U",
        ),
        ({"rollout_rs": "token_k4", "rollout_rs_threshold": "1"}, "'token_k4': unknown option"),
        ({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": "2"}, "'seq_max_k1': unknown"),
        ({"rollout_rs": " , ", "rollout_rs_threshold": "2"}, "rollout_rs names no option"),
        ({"rollout_rs": "token_k1"}, "needs rollout_rs_threshold"),
        ({"rollout_rs_threshold": "2"}, "rollout_rs_threshold is set but rollout_rs is not"),
        (
            {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.5"},
            "'0.5' for token_k1: one number X means L = 1/X, U = X, so X must be >= 1",
        ),
        (
            {"rollout_rs": "token_k1", "rollout_rs_threshold": "2_1"},
            "'2_1' for token_k1: lower bound 2 is above upper bound 1",
        ),
        (
            {"rollout_rs": "seq_sum_k1,token_k3", "rollout_rs_threshold": "0.5_2,abc"},
            "rollout_rs_threshold 'abc' for token_k3: 'abc' is not a number",
        ),
        ({"presets": ("token_is", "nope")}, "preset 'nope': unknown; valid: token_is, seq_is"),
    ],
)
def test_bad_specs_raise_one_line(kwargs: dict, message: str) -> None:
    with pytest.raises(ProbeError) as info:
        MetricsConfig(**kwargs)
    assert message in str(info.value)
    assert "\n" not in str(info.value)
