"""Rack simulator and layout planner (docs/simulator.md): `wideserve simulate`.

A front-end tool: it imports only plain modules below it (model configs and KV specs, the EPLB
policy, the workload generator) and the engine only inside `calibrate`, which measures it.
"""
