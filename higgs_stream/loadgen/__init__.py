"""Load generator: a real WebSocket client of a running server, measuring what a listener hears.
`python -m higgs_stream.loadgen --help` (`__main__.py`); docs/LOADGEN.md has every metric.

    listener.py  the simulated real-time listener (pure)
    schedule.py  scenarios, Poisson arrivals, each client process's share of a scenario
    client.py    WebSocket requests, a process's share of a scenario, the client processes
    gpu.py       GPU busy share sampled during a run
    spawn.py     the server's /healthz; --spawn's server subprocess
    runner.py    a run: the scenarios one after another, the result document
    report.py    progress lines, per-scenario summaries, the table and the plot
"""
