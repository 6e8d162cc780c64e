"""Stand-ins for the exporter's peers (a kubelet, the Kubernetes API, NVML, an agent),
fake torch, and the programs tests run as processes (servers, GPU scenarios)."""
