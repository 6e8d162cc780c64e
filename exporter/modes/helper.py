"""exporter.start() in a server: a probe in each process that called it, one helper process
beside them that reads the machine and serves (exporter.helper). `run`'s launcher without
a command: the same families, readiness and fan-out actions."""

from __future__ import annotations

from exporter.modes.mode import Mode
from exporter.modes.run import MODE as RUN
from exporter.modes.run import every_process_reports
from exporter.traits import Traits

MODE = Mode(
    Traits("helper", RUN.traits.has, one_process=False),
    "beside a PyTorch server: exporter.start() leaves a probe in the process and starts (or "
    "joins) one helper process for the port",
    "the helper's HTTP server, one /metrics for every process that called start() with that port",
    "each process that called start() (or the one chosen), through its probe",
    RUN.ready_when,
    every_process_reports,
    None,  # the helper passes its fan-out to the probes
    reads=RUN.reads,
)
