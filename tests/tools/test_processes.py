"""The benchmarks' per-thread scheduler figures (cluster/tools/bench/processes.py)."""

from __future__ import annotations

import os
import threading
import time

from cluster.tools.bench.processes import busiest_threads_wait, run_delays


def test_the_busiest_thread_of_each_engine_process_over_an_interval():
    before = {"decode[7]/7": (1.0, 0.5), "decode[7]/8": (0.0, 0.0), "prefill[9]/9": (2.0, 1.0),
              "ingress[3]/3": (0.0, 0.0)}
    after = {"decode[7]/7": (1.5, 0.75), "decode[7]/8": (2.0, 1.5), "decode[7]/10": (0.25, 0.0),
             "prefill[9]/9": (2.5, 2.0), "ingress[3]/3": (9.0, 9.0)}
    # decode: thread 8 ran 2 s (thread 7 only 0.5, the new thread 10 0.25); the ingress is not an engine
    assert busiest_threads_wait(before, after) == {"decode[7]": (2.0, 1.5), "prefill[9]": (0.5, 1.0)}


def test_run_delays_reads_this_process_s_threads_from_the_kernel():
    pid, me = os.getpid(), f"me/{threading.get_native_id()}"
    before = run_delays({"me": pid})
    spent = time.thread_time()
    while time.thread_time() - spent < 0.1:  # this thread on a CPU for 0.1 s
        pass
    spent = time.thread_time() - spent
    after = run_delays({"me": pid})
    assert set(after) == {f"me/{tid}" for tid in os.listdir(f"/proc/{pid}/task")}  # every thread, by its tid
    # the same kernel clock as thread_time (its sum_exec_runtime), read up to a scheduler tick late
    assert abs((after[me][0] - before[me][0]) - spent) < 0.02, (before[me], after[me], spent)
    assert after[me][1] >= before[me][1]  # time waiting for a CPU only grows
    assert run_delays({"gone": 2**22 + 1}) == {}  # above pid_max's default: no such process
