"""The CPU's cache sizes as Linux reports them (sysfs; Python's os.sysconf knows no
_SC_LEVEL*_CACHE_SIZE names)."""
from __future__ import annotations

from pathlib import Path

CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _size(text: str) -> int:
    text = text.strip()
    if text and text[-1] in UNITS:
        return int(text[:-1]) * UNITS[text[-1]]
    return int(text)


def last_level_cache_bytes(root: Path = CACHES) -> int:
    """Bytes of the highest-level data or unified cache of CPU 0, 0 where none is reported
    (its whole size, though a VM or a chiplet CPU may give a core only part of it)."""
    best_level, best = 0, 0
    for index in sorted(root.glob("index*")):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level = int((index / "level").read_text())
            size = _size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if level > best_level:
            best_level, best = level, size
    return best
