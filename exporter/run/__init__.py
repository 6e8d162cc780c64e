"""`gpumem-exporter run`: the launcher, the supervisor of the server's process tree, its keeper
(the reaper), and what loads the agent into each Python process of the server (inject/,
exporter.run.agent). The agent, its protocol and the aggregator are exporter.transport's.

Standard library only at import time: sitecustomize loads exporter.run.agent into every process.
"""
