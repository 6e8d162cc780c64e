"""`gpumem-exporter run`: the launcher, the agent in each Python process of the server, the
aggregator that serves them all on one endpoint, and the protocol between them.

Standard library only at import time: sitecustomize loads the agent into every process.
"""
