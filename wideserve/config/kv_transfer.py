"""`--kv-transfer-config`: how an instance takes part in prefill/decode disaggregation.

Spelled as vLLM spells it: `{"kv_connector": "NixlConnector", "kv_role": "kv_producer" |
"kv_consumer" | "kv_both", ...}`. A producer (prefill instance) holds a finished request's
blocks under a lease until a consumer (decode instance) has pulled them, or until it has
pushed them into blocks the consumer allocated (`kv_transfer_op`, the consumer's choice); a
consumer loads the KV of requests that arrive with `kv_transfer_params` from a producer.

The shared secret that authenticates the side channel never travels in this config (it
would show on command lines): it comes from the file named by `kv_secret_file` or from the
environment variable WIDESERVE_KV_SECRET.
"""
from __future__ import annotations

import dataclasses
import json
import os
import uuid
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

FLAG = "--kv-transfer-config"
SECRET_ENV = "WIDESERVE_KV_SECRET"
CONNECTORS = ("NixlConnector", "LoopbackConnector")
ROLES = ("kv_producer", "kv_consumer", "kv_both")
POLICIES = ("recompute", "fail")
TRANSFER_OPS = ("push", "pull")


def load_secret(path: str | None) -> bytes | None:
    """The shared KV secret from `path`, else $WIDESERVE_KV_SECRET; None if shorter than 16
    bytes (or absent)."""
    data = Path(path).read_bytes().strip() if path else os.environ.get(SECRET_ENV, "").encode()
    return data if len(data) >= 16 else None


# The NIXL progress thread's idle wake-up period by default (KVTransferConfig.kv_progress_poll_us).
DEFAULT_PROGRESS_POLL_US = 1000


@dataclass(slots=True)
class KVTransferConfig:
    kv_connector: str = "NixlConnector"
    kv_role: str = "kv_both"
    engine_id: str = ""                    # unique per instance; "" = a fresh uuid
    kv_ip: str = "127.0.0.1"               # side-channel address peers connect to
    kv_port: int = 0                       # side-channel port; 0 = any free port
    kv_secret_file: str | None = None      # else $WIDESERVE_KV_SECRET
    kv_load_failure_policy: str = "recompute"
    kv_lease_s: float = 30.0               # producer: free held blocks after this long
    kv_load_timeout_s: float = 10.0        # consumer: a load (handshake + pull) that takes longer fails
    max_new_kv_loads_per_step: int = 4     # consumer: new remote loads admitted per step (0 = no cap)
    kv_buffer_device: str = "auto"         # DRAM on CPU, VRAM on GPU: follows the KV tensors (a
                                           # different value must agree with them)
    # consumer: "pull" = this side READs (the default: it alone decides when its blocks stop
    # changing), "push" = the producer WRITEs into the blocks this side allocated (one packed
    # write + a notification; 2.5x faster over UCX tcp for contiguous pages, equal on local
    # transports, but a producer that stalls mid-write can land it late: docs/disaggregation.md)
    kv_transfer_op: str = "pull"
    # The NIXL progress thread's idle wake-up period (µs; whole ms in effect). It sleeps in
    # poll() on the transport's events, so transfers wake it at once; 0 is NIXL's own
    # default, a busy poll that holds a core per agent (docs/disaggregation.md).
    kv_progress_poll_us: int = DEFAULT_PROGRESS_POLL_US
    # Test/benchmark knobs: {"inject_load_failures": n, "transfer_mode": "packed" | "per_block"}
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.engine_id:
            self.engine_id = uuid.uuid4().hex[:16]
        problems = []
        if self.kv_connector not in CONNECTORS:
            problems.append(f"kv_connector must be one of {', '.join(CONNECTORS)}, "
                            f"got {self.kv_connector!r}")
        if self.kv_role not in ROLES:
            problems.append(f"kv_role must be one of {', '.join(ROLES)}, got {self.kv_role!r}")
        if self.kv_load_failure_policy not in POLICIES:
            problems.append(f"kv_load_failure_policy must be 'recompute' or 'fail', got "
                            f"{self.kv_load_failure_policy!r}")
        if self.kv_buffer_device not in ("auto", "cpu", "cuda"):
            problems.append(f"kv_buffer_device must be 'auto', 'cpu' or 'cuda', got "
                            f"{self.kv_buffer_device!r}")
        if self.kv_transfer_op not in TRANSFER_OPS:
            problems.append(f"kv_transfer_op must be 'push' or 'pull', got "
                            f"{self.kv_transfer_op!r}")
        mode = self.kv_connector_extra_config.get("transfer_mode", "packed")
        if mode not in ("packed", "per_block"):
            problems.append(f"kv_connector_extra_config.transfer_mode must be 'packed' or "
                            f"'per_block', got {mode!r}")
        if not 0 <= self.kv_port < 65536:
            problems.append(f"kv_port must be in [0, 65535], got {self.kv_port}")
        if self.kv_lease_s <= 0 or self.kv_load_timeout_s <= 0:
            problems.append("kv_lease_s and kv_load_timeout_s must be > 0")
        if not 0 <= self.kv_progress_poll_us <= 1_000_000:
            problems.append(f"kv_progress_poll_us must be in [0, 1000000], got "
                            f"{self.kv_progress_poll_us}")
        if self.max_new_kv_loads_per_step < 0:
            problems.append("max_new_kv_loads_per_step must be >= 0")
        if problems:
            raise ValueError(f"{FLAG}: " + "; ".join(problems))

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def for_dp_rank(self, rank: int) -> KVTransferConfig:
        """One rank's config in a data-parallel group: every rank runs its own connector (its
        own KV cache), so it needs its own NIXL agent name and, when fixed, side-channel port."""
        return dataclasses.replace(self, engine_id=f"{self.engine_id}-dp{rank}",
                                   kv_port=self.kv_port + rank if self.kv_port else 0)

    def secret(self) -> bytes:
        """The side-channel secret; a clear error naming the flag when there is none."""
        data = load_secret(self.kv_secret_file)
        if data is None:
            raise ValueError(f"{FLAG}: the side channel needs a shared secret of >= 16 bytes in "
                             f"kv_secret_file or ${SECRET_ENV} (the same on prefill and decode)")
        return data

    def consumer_secret(self) -> bytes | None:
        """The key an API server checks incoming handles with: a consumer's secret, else None."""
        return self.secret() if self.is_consumer else None

    @classmethod
    def parse(cls, value: str | dict[str, Any] | KVTransferConfig | None
              ) -> KVTransferConfig | None:
        if value is None or isinstance(value, KVTransferConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"{FLAG}: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{FLAG}: expected a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"{FLAG}: unknown key(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known))}")
        try:
            return cls(**value)
        except TypeError as e:
            raise ValueError(f"{FLAG}: {e}") from None
