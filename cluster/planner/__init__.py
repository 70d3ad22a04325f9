"""Capacity planning for P/D serving (issue 42): a calibrated cost profile of one engine
(`profile.py`, measured by `calibrate.py`), a discrete-event simulator of the whole P/D path
(`simulator.py`) over a workload (`workload.py`), a search for the cheapest configuration that
meets an SLO (`plan.py`), and the simulator's error against real runs (`validation.py`; the runs
themselves: cluster/tools/bench/plan_validation.py). No Ray; only `calibrate.py` imports torch."""
