"""Kubernetes attribution for the node daemon: which pod, namespace and container each GPU
and each GPU process belongs to.

- podresources: the kubelet's pod-resources gRPC API (which container each device is assigned
  to), through grpcio and a private protobuf descriptor pool built from the published schema.
- device_ids: device IDs as device plugins write them, resolved to NVML GPU UUIDs.
- cgroup: a process's pod UID and container ID from /proc/<pid>/cgroup.
- container_logs: what the kubelet calls those UIDs and IDs, from the links it makes in
  /var/log/containers (no API access needed).
- pods, claims: the Kubernetes API's pods and ResourceClaims of the node (optional readers).

exporter.sources.kubelet reads them into samples; exporter.attribution joins them with NVML.
"""
