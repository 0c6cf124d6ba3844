"""Making a NIXL agent whose idle progress thread sleeps.

NIXL's Python wrapper (`nixl._api.nixl_agent`, 1.5.x) builds its `nixlAgentConfig` with
`pthrDelay = 0`. The UCX backend's progress thread waits in `poll()` on the workers' event
descriptors with that delay, rounded up to whole milliseconds, as its timeout: 0 makes it
spin, one whole core per agent while nothing moves (docs/disaggregation.md, "The progress
thread"). Events still wake the thread at once; the delay only bounds the periodic wake-up
that NIXL keeps as a fallback. The wrapper has no parameter for it, so the delay is set on
the config object the wrapper builds, at the one call that constructs the native agent.
"""
from __future__ import annotations

import threading
from typing import Any

# Held while the wrapper's reference to the native constructor is swapped (agents made from
# several threads at once must each get their own delay and the original constructor back).
_BUILD_LOCK = threading.Lock()


def import_nixl() -> Any:
    """nixl's agent API (the `nixl` meta package, else the CUDA-12 wheel)."""
    try:
        from nixl import _api  # type: ignore[import-not-found]
    except ImportError:
        try:
            from nixl_cu12 import _api  # type: ignore[import-not-found,no-redef]
        except ImportError:
            raise RuntimeError("--kv-transfer-config: NixlConnector needs NIXL; install it after "
                               "torch: pip install nixl-cu12==1.5.1") from None
    return _api


def new_agent(name: str, progress_poll_us: int, sync_mode: Any = None) -> Any:
    """A UCX NIXL agent named `name` whose progress thread wakes at least every
    `progress_poll_us` microseconds when idle (0: NIXL's own busy poll)."""
    api = import_nixl()
    bind = api.nixlBind
    native = bind.nixlAgent
    seen: list[int] = []

    def build(agent_name: str, agent_config: Any) -> Any:
        agent_config.pthrDelay = progress_poll_us
        seen.append(agent_config.pthrDelay)
        return native(agent_name, agent_config)

    config = api.nixl_agent_config(backends=["UCX"], sync_mode=sync_mode)
    with _BUILD_LOCK:
        bind.nixlAgent = build
        try:
            agent = api.nixl_agent(name, config)
        finally:
            bind.nixlAgent = native
    if seen != [progress_poll_us]:
        # A NIXL whose wrapper builds the agent another way: the delay was not applied.
        raise RuntimeError(f"NIXL {getattr(api, '__version__', '?')}: could not set the "
                           f"progress thread's poll delay (kv_progress_poll_us)")
    return agent
