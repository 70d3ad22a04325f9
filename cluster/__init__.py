"""pdserve's shared code (not Ray cluster configuration: that is deploy/cluster.yaml).

Layers, lowest first: `engine` (what both pools run) <- `serving` (Ray Serve plumbing) <- `app`
(builder, CLI); `tools` (benchmarks, load generator) stands aside. `config.py` is the app config.
"""
