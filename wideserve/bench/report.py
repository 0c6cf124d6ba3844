"""What every benchmark result records about where and when it ran."""
from __future__ import annotations

import datetime as _dt
import os
import platform
import sys
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


BUNDLED_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "shakespeare-v4-tiny"


def machine_info() -> dict[str, Any]:
    """Where and when; torch details only if this process already imported it (the HTTP
    client must stay light: importing torch costs seconds)."""
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model(),
        "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()]
        if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads(),
                    cuda=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    return info
