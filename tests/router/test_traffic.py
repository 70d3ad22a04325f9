"""The traffic policy: splits within binomial bounds, sticky keys, minimal movement when a split
changes, tenant overrides, shadow fractions."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from router.traffic import Shadow, TrafficPolicy


def within_binomial(count: int, n: int, p: float, sigmas: float = 4.0) -> bool:
    mean, sd = n * p, math.sqrt(n * p * (1 - p))
    return abs(count - mean) <= sigmas * sd


@pytest.mark.parametrize("keyed", [False, True])
def test_a_90_10_split_over_400_requests_is_within_binomial_bounds(keyed):
    policy = TrafficPolicy.of({"v1": 90, "v2": 10}, salt="m")
    rng = random.Random(7)
    got = Counter(policy.choose(f"user-{i}" if keyed else None, "t", rng).version for i in range(400))
    assert set(got) == {"v1", "v2"} and got["v1"] + got["v2"] == 400
    assert within_binomial(got["v2"], 400, 0.10), got  # 40 +- 24


def test_a_sticky_key_keeps_its_version_across_50_requests():
    policy = TrafficPolicy.of({"v1": 50, "v2": 50}, salt="m")
    rng = random.Random(1)
    for key in ("alice", "bob", "carol"):
        versions = {policy.choose(key, "t", rng).version for _ in range(50)}
        assert versions == {policy.version_at(policy.point(key))}
    assert {policy.choose(k, "t", rng).why for k in ("alice", None)} == {"sticky", "random"}


def test_changing_the_split_moves_only_the_slice_that_changes_hands():
    before = TrafficPolicy.of({"v1": 90, "v2": 10}, salt="m")
    after = TrafficPolicy.of({"v1": 80, "v2": 20}, salt="m")
    keys = [f"k{i}" for i in range(2000)]
    moved = Counter((before.version_at(before.point(k)), after.version_at(after.point(k))) for k in keys)
    assert moved[("v2", "v1")] == 0  # nobody leaves the canary as it grows
    assert within_binomial(moved[("v1", "v2")], 2000, 0.10)
    assert moved[("v1", "v1")] + moved[("v2", "v2")] + moved[("v1", "v2")] == 2000


def test_the_salt_places_one_key_independently_per_model():
    a, b = TrafficPolicy.of({"v1": 1, "v2": 1}, salt="model-a"), TrafficPolicy.of({"v1": 1, "v2": 1}, salt="model-b")
    keys = [f"k{i}" for i in range(400)]
    same = sum(a.version_at(a.point(k)) == b.version_at(b.point(k)) for k in keys)
    assert within_binomial(same, 400, 0.5)


def test_tenant_overrides_win_over_the_split_and_the_key():
    policy = TrafficPolicy.of({"v1": 100, "v2": 0}, tenant_overrides={"internal": "v2"})
    rng = random.Random(0)
    assert {policy.choose(f"k{i}", "internal", rng).version for i in range(50)} == {"v2"}
    assert {policy.choose(f"k{i}", "other", rng).version for i in range(50)} == {"v1"}  # weight 0: never


def test_shadow_mirrors_its_fraction_and_never_the_version_already_serving():
    policy = TrafficPolicy.of({"v1": 90, "v2": 10}, shadow=Shadow("v2", 0.25))
    rng = random.Random(3)
    picks = [policy.choose(None, "t", rng) for _ in range(2000)]
    on_v1 = [a for a in picks if a.version == "v1"]
    assert all(a.shadow is None for a in picks if a.version == "v2")
    assert within_binomial(sum(a.shadow == "v2" for a in on_v1), len(on_v1), 0.25)


@pytest.mark.parametrize("kw, message", [
    (dict(split=()), "at least one version"),
    (dict(split=(("v1", 1), ("v1", 2))), "listed twice"),
    (dict(split=(("v1", 0),)), "positive sum"),
    (dict(split=(("v1", -1), ("v2", 2))), "positive sum"),
    (dict(split=(("v1", float("nan")),)), "positive sum"),
    (dict(split=(("v1", 1),), tenant_overrides={"t": "v9"}), "tenant_overrides.t: unknown version 'v9'"),
    (dict(split=(("v1", 1),), shadow=Shadow("v9", 0.1)), "shadow.version: unknown version 'v9'"),
    (dict(split=(("v1", 1),), shadow=Shadow("v1", 1.5)), r"shadow.fraction: must be in \[0, 1\]"),
])
def test_a_bad_policy_is_refused_naming_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        TrafficPolicy(**kw)
