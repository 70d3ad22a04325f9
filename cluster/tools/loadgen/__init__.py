"""`pdserve bench`: a load generator for a running pdserve (gRPC, or OpenAI HTTP with SSE).

    datasets.py  what each request asks: random lengths, shared prefixes, multi-turn sessions
    files.py     datasets read from files: ShareGPT JSON, trace replay JSONL
    arrivals.py  when sessions start: Poisson / gamma arrivals, or a trace's own timestamps
    records.py   what one request measured (client-side timestamps, usage, error code)
    clients.py   one asyncio client per API: gRPC `pdserve.v1.Generation/Generate`, OpenAI SSE
    runner.py    drives a run: arrivals, concurrency cap, sessions, warm-up, time bound, progress
    report.py    records -> metrics (TTFT, TPOT, ITL, E2E, throughput, goodput), vLLM field names
    plots.py     latency CDFs and throughput over time (PNG)
    compare.py   two result files side by side with ratios
    cli.py       the `pdserve bench` and `pdserve bench compare` commands
"""
