"""A DP group left behind (destroy()) leaves nothing a later group in the same process trips
on: three groups one after the other on the same rendezvous port, each with both step syncs
and an EP-style all-to-all, while the earlier group objects are still referenced (as a
shut-down engine that was not collected yet holds its group). Rank 0 leaves each group late,
so rank 1 first reaches the old group's store (a race CI once lost)."""
from __future__ import annotations

import numpy as np

from dist_utils import free_port, run_ranks


def _rounds(rank: int, world: int, port: int) -> list:
    import torch
    import torch.distributed as dist
    from wideserve.config import ParallelConfig
    from wideserve.parallel.dp_sync import GlooStepSync, RecursiveDoublingSync
    from wideserve.parallel.groups import init_dp_group
    import time
    kept, out = [], []
    for r in range(3):
        group = init_dp_group(ParallelConfig(
            data_parallel_size=world, data_parallel_rank=rank, data_parallel_rpc_port=port,
            enable_expert_parallel=True, dp_sync_timeout_s=20), torch.device("cpu"))
        syncs = [GlooStepSync(group), RecursiveDoublingSync(group)]
        rows = [s.exchange(np.array([r, rank, 0])).tolist() for s in syncs]
        x = torch.full((world,), float(10 * r + rank))
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x, group=group.device_group)
        out.append((rows, y.tolist()))
        for s in syncs:
            s.close()
        if rank == 0:
            time.sleep(0.3)     # rank 1 reaches the next group while the old server is up
        group.destroy()
        assert not dist.is_initialized() and group.store is None
        kept.append(group)
    return out


def test_groups_rebuilt_on_the_same_port_in_one_process():
    world = 2
    results = run_ranks(_rounds, world, (world, free_port()), timeout_s=120)
    for rank, rounds in enumerate(results):
        assert len(rounds) == 3
        for r, (rows, gathered) in enumerate(rounds):
            assert rows == [[[r, q, 0] for q in range(world)]] * 2
            assert gathered == [float(10 * r + q) for q in range(world)]


_QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
              "vocab_size": 160, "hidden_size": 48, "intermediate_size": 96,
              "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
              "num_experts_per_tok": 2, "norm_topk_prob": True,
              "max_position_embeddings": 512, "tie_word_embeddings": False,
              "rms_norm_eps": 1e-6, "hidden_act": "silu"}


def _engines(rank: int, world: int, port: int, model: str) -> list:
    """A DEP rank built, stopped (the agreed stop) and closed as its engine process closes it
    (LockstepLoop.close), three times in one process on one port."""
    from wideserve.config import CacheConfig, EngineConfig, LoadConfig, ParallelConfig
    import tempfile
    from wideserve.engine.dp_engine import DPEngineCore, LockstepLoop
    sockets = tempfile.mkdtemp(prefix="ws-lifecycle-")
    kept, out = [], []
    for _ in range(3):
        engine = DPEngineCore(EngineConfig(
            load=LoadConfig(model=model, load_format="dummy", dtype="float32"),
            cache=CacheConfig(block_size=16, kv_cache_memory=1 << 22),
            parallel=ParallelConfig(data_parallel_size=world, data_parallel_rank=rank,
                                    data_parallel_rpc_port=port, enable_expert_parallel=True,
                                    dp_sync_timeout_s=20)))
        out.append((engine.dp.num_local_experts, engine.dp_step(stop=True)))
        # The engine process's exit path (run_engine_process closes its loop).
        LockstepLoop(engine, f"ipc://{sockets}/in", f"ipc://{sockets}/out", None).close()
        kept.append(engine)         # not collected: it must not hold the port either
    return out


def test_dep_engine_rebuilt_in_one_process_after_close(tmp_path):
    import json
    (tmp_path / "config.json").write_text(json.dumps(_QWEN3_MOE))
    world = 2
    results = run_ranks(_engines, world, (world, free_port(), str(tmp_path)), timeout_s=240)
    assert results == [[(4, None)] * 3] * world


def test_store_reset_between_connect_and_check_is_retried(monkeypatch):
    """The closing server of the previous group may reset the connection after the client's
    handshake and before its check (the race CI lost in session 14): the rank connects again
    to the new server instead of failing to join."""
    from datetime import timedelta
    import torch.distributed as dist
    from wideserve.config import ParallelConfig
    from wideserve.parallel import groups
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    real, made = dist.TCPStore, []

    class ResetOnFirstCheck:
        def __init__(self, *args, **kwargs):
            self._store = real(*args, **kwargs)
            made.append(self)

        def check(self, keys):
            if len(made) == 1:
                raise dist.DistNetworkError("Connection reset by peer")
            return self._store.check(keys)

        def __getattr__(self, name):
            return getattr(self._store, name)

    monkeypatch.setattr(groups.dist, "TCPStore", ResetOnFirstCheck)
    store = groups._connect_store(ParallelConfig(data_parallel_size=2, data_parallel_rank=1,
                                                 data_parallel_rpc_port=port),
                                  timedelta(seconds=10))
    store.set("joined", "1")
    assert len(made) == 2 and master.get("joined") == b"1"


def test_store_that_keeps_resetting_fails_at_the_timeout(monkeypatch):
    from datetime import timedelta
    import pytest
    import torch.distributed as dist
    from wideserve.config import ParallelConfig
    from wideserve.parallel import groups
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=5))
    real = dist.TCPStore

    class AlwaysReset:
        def __init__(self, *args, **kwargs):
            self._store = real(*args, **kwargs)

        def check(self, keys):
            raise dist.DistNetworkError("Connection reset by peer")

    monkeypatch.setattr(groups.dist, "TCPStore", AlwaysReset)
    with pytest.raises(RuntimeError, match="reset the connection"):
        groups._connect_store(ParallelConfig(data_parallel_size=2, data_parallel_rank=1,
                                             data_parallel_rpc_port=port),
                              timedelta(seconds=0.5))
    assert not master.check(["joined"])      # nothing ever joined through a reset store
