"""Policy around the flow: an ordered list of stages (auth, admission, capacity, budget, guardrails,
response cache, telemetry, audit)."""
