"""Aside: benchmarks and the load generator (`pdserve bench`). No serving code imports them."""
