"""Per-rank devices (wideserve/parallel/devices.py) on a simulated list of devices: which
rank runs where on one node and on several, the refusals, and that a DP engine rank hands its
own device (not --device as given) to its model and to its process group."""
from __future__ import annotations

import pytest
import torch

from wideserve.config import EngineConfig, LoadConfig, ParallelConfig
from wideserve.parallel import devices as dev
from wideserve.engine import dp_engine
from wideserve.parallel.devices import DevicePlanError, plan_devices, rank_device
from wideserve.parallel.groups import backend_for

GPUS8 = [f"cuda:{i}" for i in range(8)]


def _par(size: int, rank: int = 0, local: int | None = None, start: int = 0) -> ParallelConfig:
    return ParallelConfig(data_parallel_size=size, data_parallel_rank=rank,
                          data_parallel_size_local=local, data_parallel_start_rank=start)


def test_single_node_rank_r_on_device_r() -> None:
    plan = plan_devices(_par(8), "cuda", GPUS8)
    assert plan.table() == [(r, f"cuda:{r}") for r in range(8)]
    assert [rank_device(_par(4, rank=r), "cuda", GPUS8) for r in range(4)] == GPUS8[:4]


def test_multi_node_local_rank_indexes_the_node_devices() -> None:
    # DEP16 over two 8-GPU nodes: node 1 runs ranks 8..15 on its own cuda:0..7.
    node1 = plan_devices(_par(16, local=8, start=8), "cuda", GPUS8)
    assert node1.table() == [(8 + i, f"cuda:{i}") for i in range(8)]
    assert rank_device(_par(16, rank=13, local=8, start=8), "cuda", GPUS8) == "cuda:5"
    # A node started with CUDA_VISIBLE_DEVICES=4,5 sees them as cuda:0 and cuda:1.
    assert plan_devices(_par(4, local=2, start=2), "cuda", ["cuda:0", "cuda:1"]).devices == (
        "cuda:0", "cuda:1")
    with pytest.raises(DevicePlanError, match="rank 3 is not on this node"):
        plan_devices(_par(16, local=2, start=0), "cuda", GPUS8).device_for(3)


def test_more_local_ranks_than_devices_is_refused_naming_the_flags(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(DevicePlanError) as e:
        plan_devices(_par(16, local=4, start=4), "cuda", ["cuda:0", "cuda:1"])
    msg = str(e.value)
    for needle in ("4 data-parallel ranks", "--data-parallel-size 16",
                   "--data-parallel-size-local 4", "sees 2 cuda device(s)",
                   "CUDA_VISIBLE_DEVICES='0,1'"):
        assert needle in msg, msg
    with pytest.raises(DevicePlanError, match="sees 0 cuda device"):
        plan_devices(_par(2), "cuda", [])


def test_pinned_index_only_for_one_local_rank() -> None:
    assert plan_devices(_par(1), "cuda:3", GPUS8).devices == ("cuda:3",)
    assert rank_device(_par(4, rank=2, local=1, start=2), "cuda:3", GPUS8) == "cuda:3"
    with pytest.raises(DevicePlanError, match="--device cuda:3 names one device but this node "
                                              "runs 2 ranks"):
        plan_devices(_par(2), "cuda:3", GPUS8)


def test_cpu_ranks_share_the_host_without_asking_torch(monkeypatch) -> None:
    def no_count(kind: str) -> int:
        raise AssertionError("the device count was asked for a CPU plan")
    monkeypatch.setattr(dev, "device_count", no_count)
    assert plan_devices(_par(32, local=16, start=16), "cpu").devices == ("cpu",) * 16


def test_visible_devices_default_to_torch_count(monkeypatch) -> None:
    monkeypatch.setattr(dev, "device_count", lambda kind: 2 if kind == "cuda" else 0)
    assert plan_devices(_par(2), "cuda").devices == ("cuda:0", "cuda:1")
    with pytest.raises(DevicePlanError):
        plan_devices(_par(3), "cuda")
    assert dev.device_count("cpu") == 0          # torch.cpu has no device_count: shared kind


def test_backend_follows_the_rank_device(monkeypatch) -> None:
    assert backend_for(torch.device("cpu")) == "gloo"
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    assert backend_for(torch.device("cuda:1")) == "nccl"


class _Stop(Exception):
    pass


def _engine_sees(monkeypatch, config: EngineConfig, visible: list[str]) -> dict:
    """What a DPEngineCore rank hands on: the model's config, the group's device, the device
    it binds. Stops before any model is built (the simulated devices do not exist)."""
    seen: dict = {}
    real_plan = dev.plan_devices
    monkeypatch.setattr(dp_engine, "rank_device", lambda p, d: real_plan(p, d, visible)
                        .device_for(p.data_parallel_rank))
    monkeypatch.setattr(dp_engine, "bind_device", lambda d: seen.setdefault("bound", d))

    def group(parallel, device):
        seen["group_device"] = device
        raise _Stop

    def engine_init(self, cfg, loaded=None):
        seen["load_device"] = cfg.load.device
        raise _Stop
    monkeypatch.setattr(dp_engine, "init_dp_group", group)
    monkeypatch.setattr(dp_engine.EngineCore, "__init__", engine_init)
    with pytest.raises(_Stop):
        dp_engine.DPEngineCore(config)
    return seen


def test_dp_engine_rank_gets_its_own_device(monkeypatch) -> None:
    # Ranks 10 and 11 of DEP16 on a node running ranks 8..15: cuda:2 and cuda:3.
    for rank in (10, 11):
        par = ParallelConfig(data_parallel_size=16, data_parallel_rank=rank,
                             data_parallel_size_local=8, data_parallel_start_rank=8,
                             enable_expert_parallel=True)
        seen = _engine_sees(monkeypatch, EngineConfig(load=LoadConfig(device="cuda"),
                                                      parallel=par), GPUS8)
        assert seen == {"bound": f"cuda:{rank - 8}", "group_device": torch.device(
            f"cuda:{rank - 8}")}
    # Without expert parallelism (no group) the model is built on the rank's device.
    par = ParallelConfig(data_parallel_size=2, data_parallel_rank=1)
    seen = _engine_sees(monkeypatch, EngineConfig(load=LoadConfig(device="cuda"),
                                                  parallel=par), GPUS8)
    assert seen == {"bound": "cuda:1", "load_device": "cuda:1"}
    par = ParallelConfig(data_parallel_size=4, data_parallel_rank=1)
    with pytest.raises(DevicePlanError, match="--data-parallel-size 4"):
        _engine_sees(monkeypatch, EngineConfig(load=LoadConfig(device="cuda"), parallel=par),
                     ["cuda:0"])


def test_headless_refuses_before_spawning(monkeypatch, capsys) -> None:
    from wideserve.serving import dp_launch as launch
    monkeypatch.setattr(dev, "device_count", lambda kind: 1)
    monkeypatch.setattr(launch, "spawn_rank", lambda *a, **k: pytest.fail("spawned a rank"))
    par = ParallelConfig(data_parallel_size=4, data_parallel_size_local=2,
                         data_parallel_start_rank=2)
    assert launch.run_headless(EngineConfig(load=LoadConfig(device="cuda"), parallel=par)) == 2
    assert "--data-parallel-size-local 2" in capsys.readouterr().err
