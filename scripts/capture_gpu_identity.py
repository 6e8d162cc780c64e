"""Capture what identifies each GPU on this machine, for DRA and MIG attribution (issue 37):
NVML's index, UUID, device minor number, PCI bus ID and MIG mode (with each MIG device's
UUID, profile and placement where MIG is on), and the UUID torch reports for each device,
under CUDA_VISIBLE_DEVICES by index and by UUID. Read-only: changes no GPU setting.

    python scripts/capture_gpu_identity.py OUT.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pynvml


def _try(call, *args):
    try:
        return call(*args)
    except pynvml.NVMLError as exc:
        return f"error: {exc}"


def nvml_devices() -> list[dict]:
    pynvml.nvmlInit()
    try:
        devices = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            mig = _try(pynvml.nvmlDeviceGetMigMode, handle)
            entry = {
                "index": index,
                "uuid": pynvml.nvmlDeviceGetUUID(handle),
                "minor_number": _try(pynvml.nvmlDeviceGetMinorNumber, handle),
                "pci_bus_id": pynvml.nvmlDeviceGetPciInfo(handle).busId,
                "name": pynvml.nvmlDeviceGetName(handle),
                "mig_mode": mig if isinstance(mig, str) else {"current": mig[0], "pending": mig[1]},
                "memory_total": pynvml.nvmlDeviceGetMemoryInfo(handle).total,
                "mig_devices": [],
            }
            if isinstance(mig, list | tuple) and mig[0] == pynvml.NVML_DEVICE_MIG_ENABLE:
                count = pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)
                for slot in range(count):
                    child = _try(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, slot)
                    if isinstance(child, str):
                        continue
                    entry["mig_devices"].append(
                        {
                            "slot": slot,
                            "uuid": pynvml.nvmlDeviceGetUUID(child),
                            "gpu_instance_id": _try(pynvml.nvmlDeviceGetGpuInstanceId, child),
                            "compute_instance_id": _try(
                                pynvml.nvmlDeviceGetComputeInstanceId, child
                            ),
                            "memory_total": pynvml.nvmlDeviceGetMemoryInfo(child).total,
                        }
                    )
            devices.append(entry)
        return devices
    finally:
        pynvml.nvmlShutdown()


TORCH = (
    "import json, torch; print(json.dumps([str(torch.cuda.get_device_properties(i).uuid) "
    "for i in range(torch.cuda.device_count())]))"
)


def torch_uuids(visible: str | None) -> object:
    env = dict(os.environ)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    done = subprocess.run(
        [sys.executable, "-c", TORCH], capture_output=True, text=True, env=env, timeout=120
    )
    return json.loads(done.stdout) if done.returncode == 0 else done.stderr[-500:]


def main() -> None:
    devices = nvml_devices()
    result = {
        "driver": None,
        "devices": devices,
        "torch_uuids": torch_uuids(None),
        "torch_uuids_visible_last_by_index": torch_uuids(str(devices[-1]["index"])),
        "torch_uuids_visible_last_by_uuid": torch_uuids(devices[-1]["uuid"]),
    }
    pynvml.nvmlInit()
    result["driver"] = pynvml.nvmlSystemGetDriverVersion()
    pynvml.nvmlShutdown()
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
