"""What the API process does when its engine core dies: exit non-zero, as vLLM does.

A front end without an engine can only answer 503, while /v1/models, /tokenize and the
process itself look alive, so a supervisor (systemd, Kubernetes, a shell loop) never restarts
it. Instead: open streams get their error event and [DONE] (the AsyncEngine fails them first),
then after `grace_s` the HTTP server shuts down and `serve` exits with code 1 and one log
line saying why. Restarting the engine in-process would hide repeated crashes and leave
clients' in-flight requests lost anyway; the supervisor is the right place to restart.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger("wideserve.server")

ENGINE_DEAD_EXIT_CODE = 1


class ExitOnEngineDeath:
    """Chains onto `client.on_dead` (after the AsyncEngine's handler); `exit_code` is what
    `serve` returns once the server has stopped."""

    def __init__(self, client: Any, server: Any, grace_s: float = 1.0) -> None:
        self.server = server
        self.grace_s = grace_s
        self.exit_code = 0
        self.reason: str | None = None
        previous = client.on_dead

        def on_dead(reason: str) -> None:
            previous(reason)
            self._stop(reason)

        client.on_dead = on_dead
        if client.dead_reason is not None:        # died before we were listening
            self._stop(client.dead_reason)

    def _stop(self, reason: str) -> None:
        if self.reason is not None:
            return
        self.reason = reason
        self.exit_code = ENGINE_DEAD_EXIT_CODE
        logger.error("engine core is gone (%s): shutting the server down, exit code %d, so "
                     "a supervisor can restart it", reason, ENGINE_DEAD_EXIT_CODE)
        asyncio.get_running_loop().call_later(self.grace_s, self._exit)

    def _exit(self) -> None:
        self.server.should_exit = True
