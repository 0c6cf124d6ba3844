"""Block tables kept across steps: one row per running request, per KV cache group.

The KV cache manager owns each request's block-table row (block ids per group; 0 = null). Its
rows only grow while a request runs, and an entry only ever changes to 0 (a sliding-window
page that left the window, never read again), so the runner mirrors them incrementally: a
step copies only the block ids appended since the request's previous step (docs/host_path.md).
Nothing per step is proportional to the context length: a decode step appends at most one id
per group and request.

Rows are reset when a request is new or resumed (`reset=True`) and freed when it finishes or
is preempted (`drop`). On the CPU the device table is the host table itself; elsewhere the
appended ids are scattered into a device copy, one small upload per group and step.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from wideserve.utils.device import to_device

_MIN_WIDTH = 16


class BlockTables:
    def __init__(self, num_groups: int, device: torch.device, rows: int = 8,
                 separate_copy: bool = False) -> None:
        """separate_copy: keep a device copy updated by scatters even on the CPU (what CUDA
        does; lets the CPU tests exercise that path)."""
        self.device = device
        self.num_groups = num_groups
        # On the CPU the device table is the host table itself.
        self._shared = device.type == "cpu" and not separate_copy
        self._host = [np.zeros((rows, _MIN_WIDTH), dtype=np.int64) for _ in range(num_groups)]
        self._dev = [self._mirror(t) for t in self._host]
        # Ids held per row and group: Python ints, read per request and step (a numpy scalar
        # read costs several times a list's).
        self._len: list[list[int]] = [[0] * num_groups for _ in range(rows)]
        self._row: dict[str, int] = {}
        self._free = list(range(rows - 1, -1, -1))
        self._pending: list[list[tuple[int, int, Sequence[int]]]] = [[] for _ in range(num_groups)]

    # ----------------------------------------------------------------------- rows
    def update(self, request_id: str, block_ids: Sequence[Sequence[int]],
               reset: bool = False) -> int:
        """The request's row, after appending the ids beyond those it already holds.
        block_ids: per group, the manager's current row (read, not kept)."""
        row = self._row.get(request_id)
        if row is None:
            row = self._take_row()
            self._row[request_id] = row
        elif reset:
            self._clear(row)
        held = self._len[row]
        for g, ids in enumerate(block_ids):
            have, n = held[g], len(ids)
            if n <= have:
                continue
            if n > self._host[g].shape[1]:
                self._widen(g, n)
            new = ids[have:n]
            self._host[g][row, have:n] = new
            held[g] = n
            if not self._shared:
                self._pending[g].append((row, have, new))
        return row

    def drop(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            row = self._row.pop(rid, None)
            if row is not None:
                self._clear(row)
                self._free.append(row)

    def reserve_row(self) -> int:
        """A row no request will get: all null blocks in every group, for ever (the padding
        rows of a captured decode step, worker/decode_capture.py)."""
        return self._take_row()

    def reserve(self, rows: int, widths: Sequence[int]) -> None:
        """Grow now to at least `rows` rows and `widths[g]` blocks per row of group g, so no
        later update reallocates (a captured CUDA graph holds the tables' addresses)."""
        while len(self._len) < rows:
            self._grow_rows()
        for g, width in enumerate(widths):
            if width > self._host[g].shape[1]:
                self._regrow(g, np.pad(self._host[g],
                                       ((0, 0), (0, width - self._host[g].shape[1]))))

    # ---------------------------------------------------------------------- tables
    def host(self, group: int) -> np.ndarray:
        """[rows, width] int64 host table of `group` (entries past a row's length are 0)."""
        return self._host[group]

    def device_table(self, group: int) -> torch.Tensor:
        """[rows, width] int64 table on the device, with every update so far applied."""
        pending = self._pending[group]
        if pending:
            rows = np.concatenate([np.full(len(ids), r, dtype=np.int64) for r, _, ids in pending])
            cols = np.concatenate([np.arange(c, c + len(ids)) for _, c, ids in pending])
            vals = np.concatenate([np.asarray(ids, dtype=np.int64) for _, _, ids in pending])
            # A row cleared and refilled in one step names a cell twice: keep the last write
            # (an index_put with repeated indices applies them in no defined order).
            key = rows * self._host[group].shape[1] + cols
            _, last = np.unique(key[::-1], return_index=True)
            keep = len(key) - 1 - last
            rows, cols, vals = rows[keep], cols[keep], vals[keep]
            self._dev[group][to_device(rows, self.device), to_device(cols, self.device)] = \
                to_device(vals, self.device)
            pending.clear()
        return self._dev[group]

    # --------------------------------------------------------------------- storage
    def _mirror(self, table: np.ndarray) -> torch.Tensor:
        """The device copy of a host table (the same memory on the CPU)."""
        return torch.from_numpy(table) if self._shared else to_device(table.copy(), self.device)

    def _clear(self, row: int) -> None:
        held = self._len[row]
        for g in range(self.num_groups):
            n = held[g]
            if n:
                self._host[g][row, :n] = 0
                if not self._shared:
                    self._pending[g].append((row, 0, [0] * n))
        self._len[row] = [0] * self.num_groups

    def _take_row(self) -> int:
        if not self._free:
            self._grow_rows()
        return self._free.pop()

    def _grow_rows(self) -> None:
        """Double the rows; the new ones join the free list (lowest handed out first)."""
        old = len(self._len)
        self._len += [[0] * self.num_groups for _ in range(old)]
        for g in range(self.num_groups):
            self._regrow(g, np.pad(self._host[g], ((0, old), (0, 0))))
        self._free = list(range(2 * old - 1, old - 1, -1)) + self._free

    def _widen(self, group: int, width: int) -> None:
        host = self._host[group]
        new_width = max(width, 2 * host.shape[1])
        self._regrow(group, np.pad(host, ((0, 0), (0, new_width - host.shape[1]))))

    def _regrow(self, group: int, table: np.ndarray) -> None:
        """Replace a group's table by a larger one (amortised: sizes double); the host
        table holds every update, so the new device copy needs none of the pending ones."""
        self._pending[group].clear()
        self._host[group] = table
        self._dev[group] = self._mirror(table)
