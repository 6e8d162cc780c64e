"""Bytes as a person reads them, one way for every page and command line."""

from __future__ import annotations


def fmt_bytes(n: float) -> str:
    """1536 -> "1.50 KiB"; two digits under 10, one under 100, none above."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(n)} B"
            digits = 2 if n < 10 else 1 if n < 100 else 0
            return f"{sign}{n:.{digits}f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
