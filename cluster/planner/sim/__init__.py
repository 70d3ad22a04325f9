"""The simulator's parts, one concept a module (cluster/planner/simulator.py assembles them):

    state.py    a simulated request and replica (queues, blocks, the loads the router reads)
    events.py   the event core: the clock, the heap, arrivals, routing, starting a step
    cores.py    replicas sharing one machine's cores (a step's end moves as others start and end)
    prefill.py  a prefill replica's step: its chunks, its price, its end (first token, transfer)
    decode.py   a decode replica's step: continuous batching, KV blocks, preemption, its end
    flips.py    the run-time planner: drains and pool changes
    results.py  what a run answers (latencies, goodput, utilisation, whether it kept up)
"""
