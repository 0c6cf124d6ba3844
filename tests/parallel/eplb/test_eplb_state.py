"""EPLB pieces in one process: config parsing, the load window, the replica spread, the
balancer's size checks and its keep-what-is-balanced rule."""
from __future__ import annotations

import pytest
import torch

from wideserve.parallel.eplb import policy
from wideserve.worker.eplb_balancer import EpGroup, ExpertBalancer
from wideserve.config.eplb import EplbConfig
from wideserve.parallel.eplb.recorder import LoadRecorder
from wideserve.parallel.eplb.replicas import ReplicaTable, map_to_physical
from wideserve.layers.experts import RoutedExperts


def test_config_is_spelled_like_vllm() -> None:
    cfg = EplbConfig.parse('{"window_size": 10, "step_interval": 30, '
                           '"num_redundant_experts": 4, "log_balancedness": true}')
    assert (cfg.window_size, cfg.step_interval, cfg.num_redundant_experts) == (10, 30, 4)
    assert cfg.log_balancedness and cfg.policy_name == "auto"
    for bad, word in (('{"window_sise": 1}', "unknown key 'window_sise'"),
                      ('{"step_interval": 0}', "step_interval must be an integer >= 1"),
                      ('{"num_redundant_experts": -1}', "num_redundant_experts"),
                      ('{"policy": "magic"}', "policy must be one of"),
                      ('{"use_async": true}', "use_async"),
                      ('{"log_balancedness": 1}', "log_balancedness must be true or false"),
                      ("[1]", "must be a JSON object"), ("{", "not valid JSON")):
        with pytest.raises(ValueError, match=word.replace("(", r"\(")):
            EplbConfig.parse(bad)


def test_window_keeps_the_last_steps_and_dummy_steps_count_zero() -> None:
    rec = LoadRecorder(num_layers=2, num_slots=3, window_size=2, device=torch.device("cpu"))
    layers = [RoutedExperts(3, 4, 4) for _ in range(2)]
    rec.bind(layers)
    for step, row in enumerate(([1, 0, 0], [0, 2, 0], [0, 0, 3])):
        layers[0].expert_load += torch.tensor(row)
        layers[1].expert_load += torch.tensor(row) * 10
        rec.end_step()
        assert int(rec.pass_load.sum()) == 0
        if step == 1:
            assert rec.window_sum.tolist() == [[1, 2, 0], [10, 20, 0]]
    assert rec.window_sum.tolist() == [[0, 2, 3], [0, 20, 30]]      # step 0 fell out
    layers[0].expert_load += 5                                       # a dummy batch's routing
    rec.end_step(dummy=True)
    assert rec.window_sum.tolist() == [[0, 0, 3], [0, 0, 30]]
    rec.forget_layers([1])
    assert rec.window_sum[1].tolist() == [0, 0, 0] and int(rec.ring[:, 1].sum()) == 0


def test_spread_over_replicas_is_even_and_deterministic() -> None:
    phy2log = torch.tensor([[0, 1, 2, 0, 0, 1]])                     # expert 0 x3, 1 x2, 2 x1
    table = ReplicaTable(phy2log, num_logical=3, max_replicas=4, device=torch.device("cpu"))
    ids = torch.zeros(30, 2, dtype=torch.int64)
    ids[:, 1] = 1                                  # expert 1 always in the odd top-k column
    phys = map_to_physical(ids, table.table[0], table.count[0])
    assert torch.equal(phys, map_to_physical(ids, table.table[0], table.count[0]))
    assert torch.bincount(phys.reshape(-1), minlength=6).tolist() == [10, 15, 0, 10, 10, 15]
    # One row per call (decode, batch 1): the offset cycles the replicas across calls.
    offset = torch.zeros((), dtype=torch.int64)
    seen = [map_to_physical(ids[:1], table.table[0], table.count[0], offset)[0, 0].item()
            for _ in range(6)]
    assert seen == [0, 3, 4, 0, 3, 4] and int(offset) == 6
def test_bad_sizes_are_errors_that_name_the_key() -> None:
    layer = RoutedExperts(8, 4, 4)
    with pytest.raises(ValueError, match="num_redundant_experts.*multiple of the EP size 4"):
        ExpertBalancer("target", [layer], 8, EplbConfig(num_redundant_experts=2),
                       EpGroup(rank=0, size=4), torch.device("cpu"))


def test_keep_current_layers_the_policy_does_not_improve() -> None:
    """Rank 0's choice: a layer already as balanced as the new plan keeps its slots."""
    layers = [RoutedExperts(4, 4, 4) for _ in range(2)]
    bal = ExpertBalancer("target", layers, 4, EplbConfig(step_interval=10), EpGroup(),
                         torch.device("cpu"))
    bal.ep = EpGroup(rank=0, size=2)        # rank 0's view of 2 ranks (no group needed)
    logical = torch.tensor([[10, 10, 10, 10], [40, 30, 5, 5]])
    new = bal._choose(logical)
    assert torch.equal(new[0], bal.placement[0])               # already even: untouched
    peak = policy.rank_loads(logical, new, 2).max(1).values
    assert float(peak[1]) < 70.0                               # identity: {40, 30} on rank 0
