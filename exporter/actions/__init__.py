"""Allocator actions behind one interface (`base.Actions`), one implementation per mode:

- `local.LocalActions`: this process's own allocator (embedded exporter, and each agent of
  `gpumem-exporter run`);
- `replay.ReplayActions`: the demo, answered from a snapshot recorded on a real GPU;
- `exporter.transport.fanout.FanOutActions`: `gpumem-exporter run`, every process of the server or
  the one chosen by pid or rank, through its agent (it lives with `run`, which it needs).

The runtime picks one at start-up; the admin API, the CLI clients and remediation call only
the interface. Standard library only at import time (agents load this).
"""
