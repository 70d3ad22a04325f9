"""Ray Serve plumbing the prefill and decode pools share: the replica base, load reports to the
router and the registry, the registry actor, autoscaling, and fault-injection wrappers."""
