"""Strict construction of config dataclasses (schema.from_mapping), on WorkloadProfile."""

from __future__ import annotations

import dataclasses
import math

import pytest

from pearl_hpc.core.profile import WorkloadProfile
from pearl_hpc.core.schema import field_doc, from_mapping
from pearl_hpc.errors import ConfigError
from tests.factories import PROFILE_DEFAULTS, make_profile


def data(**changes):
    out = dict(PROFILE_DEFAULTS)
    out.update(changes)
    return out


def build(d):
    return from_mapping(WorkloadProfile, d, where="profile")


def test_valid_mapping_builds_the_profile():
    p = build(data())
    assert p == make_profile()
    assert WorkloadProfile.from_dict(data()) == p
    assert p.ratio_switch_threshold == 0.05 and p.mode_switch_threshold == 0.10


def test_round_trip_through_to_dict():
    p = make_profile(ratio_switch_threshold=0.2)
    assert WorkloadProfile.from_dict(p.to_dict()) == p


def test_ints_are_accepted_for_floats():
    p = build(data(turns=40, env_s=120, prefill_s_per_token=0))
    assert p.turns == 40.0 and isinstance(p.turns, float)
    assert isinstance(p.env_s, float)
    assert p.prefill_s_per_token == 0.0 and isinstance(p.prefill_s_per_token, float)


def test_unknown_key_lists_the_valid_keys():
    with pytest.raises(ConfigError) as exc:
        build(data(batchsize=64))
    msg = str(exc.value)
    assert "'batchsize'" in msg
    assert msg.startswith("profile:")
    for f in dataclasses.fields(WorkloadProfile):
        assert f.name in msg


def test_missing_required_key_is_named():
    d = data()
    del d["gen_tokens_per_turn"]
    with pytest.raises(ConfigError) as exc:
        build(d)
    msg = str(exc.value)
    assert "profile.gen_tokens_per_turn" in msg
    assert "missing" in msg
    assert field_doc(WorkloadProfile, "gen_tokens_per_turn") in msg


def test_optional_keys_may_be_missing():
    d = data()
    assert "ratio_switch_threshold" not in d
    assert build(d).ratio_switch_threshold == 0.05


@pytest.mark.parametrize("key", ["turns", "env_s", "batch_size", "kv_bytes_per_token"])
@pytest.mark.parametrize("value", [True, False])
def test_bool_is_not_a_number(key, value):
    with pytest.raises(ConfigError) as exc:
        build(data(**{key: value}))
    assert f"profile.{key}" in str(exc.value)


@pytest.mark.parametrize("key", ["turns", "env_s", "batch_size", "prefill_s_per_token"])
def test_string_is_not_a_number(key):
    with pytest.raises(ConfigError) as exc:
        build(data(**{key: "12"}))
    msg = str(exc.value)
    assert f"profile.{key}" in msg and "'12'" in msg


def test_float_is_not_an_integer():
    with pytest.raises(ConfigError, match=r"profile\.batch_size: expected an integer"):
        build(data(batch_size=64.0))


def test_none_is_not_a_number():
    with pytest.raises(ConfigError, match=r"profile\.turns"):
        build(data(turns=None))


@pytest.mark.parametrize(
    "key",
    [
        "batch_size",
        "turns",
        "gen_tokens_per_turn",
        "kv_bytes_per_token",
        "transfer_bytes_per_s",
        "kv_bytes_per_trajectory",
        "kv_capacity_bytes_per_worker",
    ],
)
@pytest.mark.parametrize("value", [0, -1])
def test_non_positive_rejected_where_gt_zero(key, value):
    with pytest.raises(ConfigError) as exc:
        build(data(**{key: value}))
    msg = str(exc.value)
    assert f"profile.{key}" in msg
    assert "must be > 0" in msg


@pytest.mark.parametrize(
    "key",
    [
        "new_tokens_per_turn",
        "prefill_s_per_token",
        "decode_fixed_s",
        "decode_per_seq_s",
        "overhead_s_per_turn",
        "env_s",
        "decode_bubble_ratio",
    ],
)
def test_zero_allowed_negative_rejected_where_ge_zero(key):
    assert getattr(build(data(**{key: 0})), key) == 0.0
    with pytest.raises(ConfigError) as exc:
        build(data(**{key: -0.5}))
    msg = str(exc.value)
    assert f"profile.{key}" in msg and "must be >= 0" in msg


@pytest.mark.parametrize("key", ["ratio_switch_threshold", "mode_switch_threshold"])
def test_thresholds_are_fractions(key):
    assert getattr(build(data(**{key: 1})), key) == 1.0
    with pytest.raises(ConfigError, match=rf"profile\.{key}: must be <= 1"):
        build(data(**{key: 1.5}))
    with pytest.raises(ConfigError, match=rf"profile\.{key}"):
        build(data(**{key: -0.01}))


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("key", ["turns", "env_s", "transfer_bytes_per_s"])
def test_non_finite_rejected(key, value):
    with pytest.raises(ConfigError) as exc:
        build(data(**{key: value}))
    msg = str(exc.value)
    assert f"profile.{key}" in msg and "finite" in msg


def test_int_too_large_for_a_float_is_a_config_error():
    # YAML integers are unbounded: 10**400 must not crash with OverflowError
    with pytest.raises(ConfigError, match=r"profile\.env_s"):
        build(data(env_s=10**400))


def test_error_names_the_field_meaning():
    with pytest.raises(ConfigError) as exc:
        build(data(kv_capacity_bytes_per_worker=0))
    assert "H_max" in str(exc.value)


@pytest.mark.parametrize("bad", [None, [1, 2], "batch_size: 64", 3])
def test_non_mapping_rejected(bad):
    with pytest.raises(ConfigError, match="expected a mapping"):
        build(bad)


def test_where_prefix_is_optional():
    d = data(turns=-1)
    with pytest.raises(ConfigError) as exc:
        from_mapping(WorkloadProfile, d)
    assert str(exc.value).startswith("turns:")
