"""The ingress's threads run at `ingress_nice` (default 0) or better, where Ray starts its workers'
Python threads at 15: the front door gets the CPU before the engines' compute (docs/architecture.md,
"CPU priority").
Each case runs in a process of its own, so this one's priority is never touched."""

import json
import os
import subprocess
import sys

from cluster.config import AppConfig

PROBE = """
import json, os, sys, threading
os.setpriority(os.PRIO_PROCESS, 0, int(sys.argv[2]))  # 15: as Ray starts a worker's main thread (inherited)
from cluster.config import AppConfig
from router.ingress.deployment import front_door_priority

stop = threading.Event()
started = threading.Thread(target=stop.wait)  # started at 15, as the replica's threads are
started.start()
front_door_priority(AppConfig.model_validate(json.loads(sys.argv[1])))
print(sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")}))
stop.set()
"""


def niceness_after(config: dict, started_at: int = 15) -> list[int]:
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(config), str(started_at)], capture_output=True,
                         text=True, timeout=120, check=True)
    return eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 — our own probe's list of ints


def can_raise_priority() -> bool:
    try:
        os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0))
        import resource  # noqa: PLC0415
        return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20
    except OSError:
        return False


def test_by_default_every_ingress_thread_is_raised_from_ray_worker_niceness():
    assert AppConfig().ingress_nice == 0
    expected = [0] if can_raise_priority() else [15]  # refused without the privilege: a warning, Ray's 15
    assert niceness_after({}) == expected


def test_threads_already_at_a_higher_priority_keep_it_and_none_leaves_them_as_ray_set_them():
    assert niceness_after({"ingress_nice": 10}, started_at=0) == [0]  # Ray's workers at 0: never lowered
    assert niceness_after({"ingress_nice": 10}) == ([10] if can_raise_priority() else [15])
    assert niceness_after({"ingress_nice": 18}) == [15]
    assert niceness_after({"ingress_nice": None}) == [15]
