"""Numbers as a plan writes them for people: the terminal table, ``parallel=auto``'s log and its errors."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """Bytes in the largest unit that keeps a number >= 1 (decimal units, as memory is sold)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def human_count(n: float) -> str:
    """A count in the largest of k, M, B that keeps a number >= 1 (parameters: 2.43M, 46.7B)."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"
