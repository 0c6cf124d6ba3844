"""What every benchmark result records about where and when it ran."""
from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

from wideserve.utils.cpu_id import cpu_id


def cpu_model() -> str:
    """The CPU's name with its family / model / stepping (wideserve.utils.cpu_id)."""
    return cpu_id().label()


BUNDLED_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "shakespeare-v4-tiny"


def git_version() -> str | None:
    """`git describe --always --dirty` of the checkout wideserve runs from (None outside one)."""
    import subprocess
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"],
                             cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


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
        "git": git_version(),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads(),
                    cuda=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    return info


def command_line(args: Any, sub: str) -> str:
    """The command as typed when run from the CLI; else rebuilt from the parsed flags."""
    import sys as _sys
    if _sys.argv[1:3] == ["bench", sub]:
        return shlex.join(["wideserve", *_sys.argv[1:]])
    parts = ["wideserve", "bench", sub]
    for key, value in sorted(vars(args).items()):
        if key.startswith("_") or key == "bench_command" or key == "command" \
                or value in (None, False):
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif isinstance(value, list):
            parts += [flag, *map(str, value)]
        else:
            parts += [flag, str(value)]
    return shlex.join(parts)
