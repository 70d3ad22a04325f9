"""Speculative decoding: a proposer drafts tokens, the target model verifies them in the normal
engine step (cluster/engine/spec/README in the package docstrings: proposer, verify, controller)."""
