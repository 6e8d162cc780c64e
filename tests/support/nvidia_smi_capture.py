"""Read the real `nvidia-smi` captures in tests/data/captures/nvidia-smi (copied unchanged from
the workplace's shared captures: an H100 and an H200, MIG on and off, idle and under load;
MIT, from utkuozdemir/nvidia_gpu_exporter, LICENSE and README beside them) into the
facts an NVML double serves (tests/support/mig_nvml.py): every number here is parsed from a
named section of a capture file, nothing typed by hand.

A capture is one machine: sections headed `# <state> :: <name>` (`idle`, `load`, or
`capabilities` for what does not change), each the output of one command. What is read:

- `-q` (per state): the whole GPU's FB memory (total, reserved, used, free), MIG mode
  (current, pending), each MIG device (index, GPU instance ID, compute instance ID, its
  shared FB memory) and the processes (GPU instance ID, compute instance ID, PID, used);
- `-L` (capabilities): the GPU's UUID and each MIG device's profile and UUID (masked in the
  captures, but distinct: MIG-00000000-..., MIG-00000001-...).

Sizes are MiB as nvidia-smi prints them; `MIB` turns them into the bytes NVML answers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import DATA_DIR

CAPTURES = DATA_DIR / "captures" / "nvidia-smi"
MIB = 1 << 20
FILES = {
    "h100-mig": "linux-x86_64__nvidia-h100-mig__590.48.01.txt",
    "h200-mig": "linux-x86_64__nvidia-h200-mig__590.48.01.txt",
    "h100": "linux-x86_64__nvidia-h100-80gb-hbm3__590.48.01.txt",
    "h200": "linux-x86_64__nvidia-h200__590.48.01.txt",
}
_SECTION = re.compile(r"^# (\w+) :: (.+)$")
_MIG_LINE = re.compile(r"^\s+MIG (\S+)\s+Device\s+(\d+): \(UUID: (MIG-[0-9a-fA-F-]+)\)$")
_GPU_LINE = re.compile(r"^GPU (\d+): (.+) \(UUID: (GPU-[0-9a-fA-F-]+)\)$")


@dataclass(frozen=True)
class Memory:
    """FB memory in MiB, as `-q` prints it."""

    total: int
    reserved: int
    used: int
    free: int


@dataclass(frozen=True)
class MigDevice:
    index: int
    gpu_instance_id: int
    compute_instance_id: int
    profile: str  # as -L names it: 3g.40gb, or 1c.3g.71gb for one of several compute instances
    uuid: str
    memory: Memory  # the GPU instance's, shared by its compute instances


@dataclass(frozen=True)
class Process:
    pid: int
    used_mib: int
    gpu_instance_id: int | None  # None where MIG is off (N/A)
    compute_instance_id: int | None


@dataclass
class Gpu:
    """One GPU of one capture in one state."""

    name: str
    uuid: str
    pci_bus_id: str
    memory: Memory
    mig_current: bool
    mig_pending: bool
    # -L's MIG devices: index -> (profile, UUID)
    mig_listed: dict[int, tuple[str, str]] = field(default_factory=dict)
    mig_devices: list[MigDevice] = field(default_factory=list)
    processes: list[Process] = field(default_factory=list)
    minor_number: int | None = None


def sections(path: Path) -> dict[tuple[str, str], list[str]]:
    """(state, section name) -> the section's output lines, banners and command left out."""
    found: dict[tuple[str, str], list[str]] = {}
    current: list[str] | None = None
    for line in path.read_text().splitlines():
        header = _SECTION.match(line)
        if header is not None:
            current = found.setdefault((header.group(1), header.group(2).strip()), [])
            continue
        if current is not None and not line.startswith(("#####", "# $ ")):
            current.append(line)
    return found


def _mib(value: str) -> int:
    number, unit = value.split()
    if unit != "MiB":
        raise ValueError(f"not MiB: {value!r}")
    return int(number)


def _instance(value: str) -> int | None:
    return None if value == "N/A" else int(value)


def _fields(lines: list[str]) -> list[tuple[int, str, str]]:
    """(indent, key, value) of each `key : value` line (value "" for a heading)."""
    found = []
    for line in lines:
        if not line.strip() or line.startswith("="):
            continue
        key, _, value = line.partition(" : ")  # keys are padded; values may hold colons
        found.append((len(line) - len(line.lstrip()), key.strip(), value.strip()))
    return found


def _memory(rows: list[tuple[int, str, str]], start: int) -> Memory:
    """The Total/Reserved/Used/Free rows that follow the heading at `start`."""
    values = {}
    for _, key, value in rows[start + 1 : start + 5]:
        values[key.lower()] = _mib(value)
    return Memory(values["total"], values["reserved"], values["used"], values["free"])


def read(name: str, state: str) -> list[Gpu]:
    """The GPUs of capture `name` (a FILES key) in `state` ("idle" or "load")."""
    found = sections(CAPTURES / FILES[name])
    listed = _listed(found[("capabilities", "list (-L)")])
    rows = _fields(found[(state, "query (-q)")])
    gpus: list[Gpu] = []
    gpu: Gpu | None = None
    mig: dict[str, int] = {}
    process: dict[str, int | None] = {}
    section = ""
    for at, (indent, key, value) in enumerate(rows):
        if indent == 0 and key.startswith("GPU ") and not value:  # "GPU 00000000:00:09.0"
            name_, uuid, profiles = listed[len(gpus)]
            bus_id = key[len("GPU ") :]
            gpu = Gpu(name_, uuid, bus_id, Memory(0, 0, 0, 0), False, False, profiles)
            gpus.append(gpu)
            continue
        if gpu is None:
            continue
        if indent == 4:
            section = key
            if key == "FB Memory Usage":
                gpu.memory = _memory(rows, at)
            elif key == "Minor Number":
                gpu.minor_number = int(value)
            continue
        if section == "MIG Mode" and key in ("Current", "Pending"):
            setattr(gpu, f"mig_{key.lower()}", value == "Enabled")
        elif section == "MIG Device":
            if key in ("Index", "GPU Instance ID", "Compute Instance ID"):
                mig[key] = int(value)
            elif key == "Shared FB Memory Usage":
                profile, uuid = gpu.mig_listed[mig["Index"]]
                gpu.mig_devices.append(
                    MigDevice(
                        mig["Index"],
                        mig["GPU Instance ID"],
                        mig["Compute Instance ID"],
                        profile,
                        uuid,
                        _memory(rows, at),
                    )
                )
        elif section == "Processes":
            if key == "GPU instance ID":
                process = {"gi": _instance(value)}
            elif key == "Compute instance ID":
                process["ci"] = _instance(value)
            elif key == "Process ID":
                process["pid"] = int(value)
            elif key == "Used GPU Memory":
                pid, used = process["pid"], _mib(value)
                assert pid is not None
                gpu.processes.append(Process(pid, used, process["gi"], process["ci"]))
    return gpus


def driver_version(name: str) -> str:
    """The driver's version, from the capture's `--version` section."""
    for line in sections(CAPTURES / FILES[name])[("capabilities", "version")]:
        key, _, value = line.partition(":")
        if key.strip() == "DRIVER version":
            return value.strip()
    raise ValueError(f"no driver version in {name}")


def _listed(lines: list[str]) -> list[tuple[str, str, dict[int, tuple[str, str]]]]:
    """(name, UUID, {MIG device index: (profile, UUID)}) of each GPU in `-L`."""
    gpus: list[tuple[str, str, dict[int, tuple[str, str]]]] = []
    for line in lines:
        gpu = _GPU_LINE.match(line)
        if gpu is not None:
            gpus.append((gpu.group(2), gpu.group(3), {}))
            continue
        mig = _MIG_LINE.match(line)
        if mig is not None:
            gpus[-1][2][int(mig.group(2))] = (mig.group(1), mig.group(3))
    return gpus
