"""exporter.start()'s helper: one process beside a server that serves what its processes'
agents send (exporter.helper.process), found or started by each process (exporter.helper.join)
through its link (exporter.helper.link), which starts it again when it dies.

    python -m exporter.helper FOLDER      # started by exporter.start()
    python -m exporter.helper --sidecar   # a container of its own (Kubernetes)
"""
