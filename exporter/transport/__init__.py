"""What `gpumem-exporter run` and exporter.start()'s helper share: the agent in each serving
process, the protocol it speaks over a Unix socket, the aggregator that takes every agent's
readings, the admin actions fanned out to the agents, and the runtime that serves them.

Standard library only at import time for the agent and the protocol: sitecustomize loads the
agent into every process of a server run under `run`.
"""
