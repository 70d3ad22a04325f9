"""Capacity planning for P/D serving (issue 42): a calibrated cost profile of one engine
(`profile.py`, measured by `calibrate.py`), a discrete-event simulator of the whole P/D path
(`simulator.py`) over a workload (`workload.py`), and a search for the cheapest configuration that
meets an SLO (`plan.py`). No Ray; only `calibrate.py` imports torch."""
