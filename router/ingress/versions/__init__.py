"""Which model version serves a request: catalog, traffic split, rollout, shadow."""
