"""Per-layer, per-physical-slot token counts, kept on the device over a sliding window.

The MoE layers count the tokens they route into `pass_load[layer]` (each layer's
`expert_load` is a view of one row), on the device, as part of the forward. Once per engine
step `end_step` folds the pass into a ring of the last `window_size` steps and a running
window sum: four small device ops, no host sync. Dummy steps (an idle DEP rank running a
batch only so the collectives line up) fold in zeros: they still advance the window, so
every rank's window covers the same steps.

Counts are per *physical slot*, so they are only meaningful under the placement they were
recorded with: when a layer's placement changes, `forget_layers` clears its history.
"""
from __future__ import annotations

import torch


class LoadRecorder:
    def __init__(self, num_layers: int, num_slots: int, window_size: int,
                 device: torch.device) -> None:
        self.window_size = window_size
        self.pass_load = torch.zeros(num_layers, num_slots, dtype=torch.int64, device=device)
        # int32 per step is plenty (tokens per step per slot) and halves the ring.
        self.ring = torch.zeros(window_size, num_layers, num_slots, dtype=torch.int32,
                                device=device)
        self.window_sum = torch.zeros(num_layers, num_slots, dtype=torch.int64, device=device)
        self.pos = 0
        self.steps = 0

    def bind(self, layers: list) -> None:
        """Make each layer count into its row of pass_load (layer.expert_load = a view)."""
        if len(layers) != self.pass_load.shape[0]:
            raise ValueError(f"{len(layers)} MoE layers, recorder built for "
                             f"{self.pass_load.shape[0]}")
        for i, layer in enumerate(layers):
            layer.expert_load = self.pass_load[i]

    def end_step(self, dummy: bool = False) -> None:
        if dummy:
            self.pass_load.zero_()
        oldest = self.ring[self.pos]
        self.window_sum -= oldest
        self.window_sum += self.pass_load
        oldest.copy_(self.pass_load)
        self.pass_load.zero_()
        self.pos = (self.pos + 1) % self.window_size
        self.steps += 1

    def forget_layers(self, layers: list[int]) -> None:
        """Drop the history of layers whose placement just changed."""
        idx = torch.tensor(layers, dtype=torch.int64, device=self.ring.device)
        self.ring.index_fill_(1, idx, 0)
        self.window_sum.index_fill_(0, idx, 0)
