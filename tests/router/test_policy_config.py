"""The routing options are declared once for the operator (cluster/config/pools.py RoutingOptions,
with their descriptions) and once for the policy (router/policy.py PolicyConfig); PolicyConfig.of
maps one onto the other by name, and this test keeps the two from drifting apart."""

from dataclasses import fields

from cluster.config import AppConfig
from cluster.config.pools import RoutingOptions
from router.policy import PolicyConfig

# what the ingress reads itself, not the policy
FRONT_DOOR_ONLY = {"enabled", "strategy", "cell_size", "cell_choice", "cell_max_choices", "cell_spill_requests"}


def test_every_routing_option_is_a_policy_field_with_the_same_default():
    policy = {f.name: f.default for f in fields(PolicyConfig)}
    options = {name: f.default for name, f in RoutingOptions.model_fields.items() if name not in FRONT_DOOR_ONLY}
    assert set(options) <= set(policy)
    assert {k: (None if v is None else tuple(v) if isinstance(v, list) else v) for k, v in options.items()} == {
        k: policy[k] for k in options}


def test_policy_of_takes_every_configured_option_and_the_block_size():
    routing = RoutingOptions(local_prefill_threshold=7, hot_load_cap=3, slow_factor=1.5, pull_block_cost=2.5,
                             evict_block_cost=0.5, tier_weights=[0.5, 0.125], session_bonus=9.0, max_sessions=11,
                             session_ttl_s=12.0)
    assert PolicyConfig.of(routing, 32) == PolicyConfig(
        block_size=32, local_prefill_threshold=7, hot_load_cap=3, slow_factor=1.5, pull_block_cost=2.5,
        evict_block_cost=0.5, tier_weights=(0.5, 0.125), session_bonus=9.0, max_sessions=11, session_ttl_s=12.0)
    assert PolicyConfig.of(AppConfig(model="m").routing, 16) == PolicyConfig()
