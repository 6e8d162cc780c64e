"""What each ResourceClaim of this node's pods consumed, from the Kubernetes API
(resource.k8s.io/v1): for a device several claims share (consumable capacity, the
DRAConsumableCapacity feature), each allocation result carries its `shareID` and
`consumedCapacity`, NVIDIA's driver's `memory` among them. The node daemon holds it against
the memory the claim's processes use on that GPU (exporter.attribution): a claim whose
processes use more than they claimed starves its neighbours on the GPU.

Optional (the chart's `daemonset.kubelet.claimReader`, GPUMEM_KUBELET_CLAIM_READER), with the
pod reader's credentials and RBAC to list resourceclaims: one list per namespace that has a
claim on this node, each bounded in size and by the API client's one deadline.
"""

from __future__ import annotations

import logging
import re
import urllib.parse
from dataclasses import dataclass
from fractions import Fraction

from exporter.kubernetes.api import ApiError, ApiServer
from exporter.ratelimit import RateLimitedLog

log = logging.getLogger(__name__)
_bad = RateLimitedLog(log)

# One namespace's claims; 10,000 claims of a few KiB each stay under it.
MAX_RESPONSE_BYTES = 64 << 20
# Namespaces asked per refresh: a node runs a few hundred pods at most.
MAX_NAMESPACES = 256

# Kubernetes' quantity grammar (k8s.io/apimachinery resource.ParseQuantity): a signed number,
# then a binary SI suffix, a decimal SI one (milli-bytes included: "1500m" is 1.5 bytes) or a
# decimal exponent ("1e3", "1E-3").
_QUANTITY = re.compile(
    r"([+-]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
    r"(?:(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)|[eE]([+-]?[0-9]+))?"
)
_FACTORS = {
    None: Fraction(1), "Ki": Fraction(1 << 10), "Mi": Fraction(1 << 20), "Gi": Fraction(1 << 30),
    "Ti": Fraction(1 << 40), "Pi": Fraction(1 << 50), "Ei": Fraction(1 << 60),
    "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000),
    "k": Fraction(10**3), "M": Fraction(10**6), "G": Fraction(10**9), "T": Fraction(10**12),
    "P": Fraction(10**15), "E": Fraction(10**18),
}  # fmt: skip
# Past any GPU's memory by far; an exponent beyond this is refused before it is computed.
MAX_EXPONENT = 30


class ClaimsApiError(RuntimeError):
    """The claims could not be read; str() is one line without secrets."""


@dataclass(frozen=True)
class ClaimedDevice:
    """One device of one claim's allocation, with the memory it consumed where the driver
    counts memory as consumable capacity (None otherwise: the whole device)."""

    driver: str
    pool: str
    device: str
    share_id: str
    memory_bytes: int | None


def parse_quantity(text: str) -> int:
    """A Kubernetes quantity of bytes ("10Gi", "1500M", "1500m", "1e3", "1073741824") as a
    whole number of bytes, rounded up; ValueError for what is no quantity, or a negative one."""
    match = _QUANTITY.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"not a quantity of bytes: {text[:40]!r}")
    sign, number, suffix, exponent = match.groups()
    value = Fraction(number if not number.endswith(".") else number[:-1]) * _FACTORS[suffix]
    if exponent is not None:
        if abs(int(exponent)) > MAX_EXPONENT:
            raise ValueError(f"a quantity of bytes out of range: {text[:40]!r}")
        value *= Fraction(10) ** int(exponent)
    if sign == "-" and value:
        raise ValueError(f"a negative quantity of bytes: {text[:40]!r}")
    return -(-value.numerator // value.denominator)


def parse_claims(data: dict) -> dict[str, list[ClaimedDevice]]:
    """A ResourceClaimList's allocations by claim name (claims not yet allocated have none)."""
    result: dict[str, list[ClaimedDevice]] = {}
    for item in data["items"]:
        name = str(item["metadata"]["name"])
        allocation = (item.get("status") or {}).get("allocation") or {}
        devices = []
        for entry in (allocation.get("devices") or {}).get("results") or []:
            consumed = entry.get("consumedCapacity") or {}
            memory = consumed.get("memory")
            try:
                memory_bytes = parse_quantity(str(memory)) if memory is not None else None
            except ValueError as exc:
                # That device of that claim only: every other claim is still read (round 4:
                # one refused quantity lost every claim of every namespace).
                _bad.warning(f"quantity:{name}", f"claim {name}: consumedCapacity {exc}")
                continue
            devices.append(
                ClaimedDevice(
                    str(entry["driver"]),
                    str(entry["pool"]),
                    str(entry["device"]),
                    str(entry.get("shareID") or ""),
                    memory_bytes,
                )
            )
        result[name] = devices
    return result


def parse_slices(data: dict) -> dict[tuple[str, str, str], str]:
    """A ResourceSliceList's devices: (driver, pool, device) -> the UUID of the GPU it is on
    (NVIDIA's driver: `uuid` of a GPU, `parentUUID` of a MIG device)."""
    found: dict[tuple[str, str, str], str] = {}
    for item in data["items"]:
        spec = item["spec"]
        driver, pool = str(spec["driver"]), str((spec.get("pool") or {}).get("name", ""))
        for device in spec.get("devices") or []:
            attributes = device.get("attributes") or {}
            for key in ("parentUUID", "uuid"):  # a MIG device is on its parent GPU
                value = (attributes.get(key) or {}).get("string")
                if value:
                    found[(driver, pool, str(device["name"]))] = str(value)
                    break
    return found


class ClaimsClient:
    def __init__(self, api: ApiServer, node_name: str = "") -> None:
        self._api = api
        self.node_name = node_name

    def slices(self) -> dict[tuple[str, str, str], str]:
        """This node's ResourceSlices' devices (parse_slices): asked only for a DRA device
        whose name does not resolve through NVML (exporter.kubernetes.device_ids)."""
        if not self.node_name:
            raise ClaimsApiError("NODE_NAME is not set: cannot select this node's ResourceSlices")
        selector = urllib.parse.quote(f"spec.nodeName={self.node_name}")
        path = f"/apis/resource.k8s.io/v1/resourceslices?fieldSelector={selector}"
        try:
            return self._api.get_list(
                path, "ResourceSliceList", parse_slices, max_bytes=MAX_RESPONSE_BYTES
            )
        except ApiError as exc:
            raise ClaimsApiError(f"listing resourceslices: {exc}") from None

    def list(self, namespaces: set[str]) -> dict[tuple[str, str], list[ClaimedDevice]]:
        """(namespace, claim) -> its allocated devices, for the claims of `namespaces`."""
        if len(namespaces) > MAX_NAMESPACES:
            raise ClaimsApiError(
                f"{len(namespaces)} namespaces with claims on this node, over {MAX_NAMESPACES}"
            )
        found: dict[tuple[str, str], list[ClaimedDevice]] = {}
        for namespace in sorted(namespaces):
            path = (
                f"/apis/resource.k8s.io/v1/namespaces/{urllib.parse.quote(namespace, safe='')}"
                "/resourceclaims"
            )
            try:
                claims = self._api.get_list(
                    path, "ResourceClaimList", parse_claims, max_bytes=MAX_RESPONSE_BYTES
                )
            except ApiError as exc:
                raise ClaimsApiError(f"listing resourceclaims in {namespace}: {exc}") from None
            found.update({(namespace, name): devices for name, devices in claims.items()})
        return found
