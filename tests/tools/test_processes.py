"""The benchmarks' per-thread scheduler figures (cluster/tools/bench/processes.py)."""

from __future__ import annotations

import os

from cluster.tools.bench.processes import busiest_threads_wait, run_delays


def test_the_busiest_thread_of_each_engine_process_over_an_interval():
    before = {"decode[7]/7": (1.0, 0.5), "decode[7]/8": (0.0, 0.0), "prefill[9]/9": (2.0, 1.0),
              "ingress[3]/3": (0.0, 0.0)}
    after = {"decode[7]/7": (1.5, 0.75), "decode[7]/8": (2.0, 1.5), "decode[7]/10": (0.25, 0.0),
             "prefill[9]/9": (2.5, 2.0), "ingress[3]/3": (9.0, 9.0)}
    # decode: thread 8 ran 2 s (thread 7 only 0.5, the new thread 10 0.25); the ingress is not an engine
    assert busiest_threads_wait(before, after) == {"decode[7]": (2.0, 1.5), "prefill[9]": (0.5, 1.0)}


def test_run_delays_reads_this_process_s_threads_from_the_kernel():
    d = run_delays({"me": os.getpid()})
    assert f"me/{os.getpid()}" in d and all(on >= 0 and wait >= 0 for on, wait in d.values())
    assert run_delays({"gone": 2**22 + 1}) == {}  # above pid_max's default: no such process
