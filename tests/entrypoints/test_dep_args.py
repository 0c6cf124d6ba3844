"""DEP flags: vLLM's spellings build the ParallelConfig; bad combinations are one-line errors
naming the flag (exit 2), never a traceback."""
from __future__ import annotations

import pytest

from wideserve.config import ParallelConfig, engine_config_from_kwargs
from wideserve.worker.expert_shard import ExpertPlacement


def _serve(capsys, *args: str) -> tuple[int, str]:
    from wideserve.entrypoints import serve
    try:
        code = serve.main(["serve", *args])
    except SystemExit as e:
        code = int(e.code or 0)
    return code, capsys.readouterr().err


def test_flags_build_the_parallel_config():
    import argparse
    from wideserve.entrypoints.engine_args import add_engine_args, engine_config_from_args
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["-dp", "4", "--data-parallel-size-local", "2",
                              "--enable-expert-parallel", "--data-parallel-address", "10.0.0.1",
                              "--data-parallel-rpc-port", "4000", "--dp-sync-timeout", "9",
                              "--dp-sync-method", "rd"])
    p = engine_config_from_args(args).parallel
    assert (p.data_parallel_size, p.local_size, p.enable_expert_parallel) == (4, 2, True)
    assert (p.data_parallel_address, p.data_parallel_rpc_port) == ("10.0.0.1", 4000)
    assert (p.dp_sync_timeout_s, p.dp_sync_method) == (9.0, "rd")


@pytest.mark.parametrize("args, flag", [
    (["--headless"], "--headless"),
    (["-dp", "2", "--data-parallel-start-rank", "1"], "--data-parallel-start-rank"),
    (["-dp", "2", "--data-parallel-size-local", "3"], "--data-parallel-size-local"),
    (["-dp", "0"], "--data-parallel-size"),
    (["-dp", "2", "--dp-sync-timeout", "0"], "--dp-sync-timeout"),
])
def test_bad_combinations_are_one_line_errors(capsys, args, flag):
    code, err = _serve(capsys, *args)
    assert code == 2
    assert flag in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_llm_kwargs_and_uneven_expert_split():
    cfg = engine_config_from_kwargs(data_parallel_size=2, enable_expert_parallel=True)
    assert cfg.parallel == ParallelConfig(data_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="data_parallel_rank"):
        engine_config_from_kwargs(data_parallel_size=2, data_parallel_rank=2)
    with pytest.raises(ValueError, match="do not split evenly"):
        ExpertPlacement(num_experts=6, ep_size=4, ep_rank=0)


def test_each_moe_stack_is_sharded_on_its_own_terms():
    """A DSpark draft's MoE (mtp.*) with its own expert count: its own slots per rank, and an
    uneven split names the draft."""
    import torch
    from torch import nn
    from wideserve.layers.experts import RoutedExperts
    from wideserve.worker.expert_shard import moe_stacks, shard_experts

    def stacks(draft_experts: int) -> nn.Module:
        with torch.device("meta"):
            m = nn.Module()
            m.layers = nn.ModuleList([RoutedExperts(8, 16, 8) for _ in range(2)])
            m.mtp = nn.ModuleList([RoutedExperts(draft_experts, 16, 8)])
        return m

    model = stacks(4)
    placements = shard_experts(model, 2, 1, num_redundant=2)
    assert {n: (p.num_local, p.start, p.stack) for n, p in placements.items()} == {
        "layers.0": (5, 5, "target"), "layers.1": (5, 5, "target"), "mtp.0": (3, 3, "draft")}
    by_stack = moe_stacks(model)
    assert [m.gate_up_proj.shape[0] for m in by_stack["target"]] == [5, 5]
    assert [m.gate_up_proj.shape[0] for m in by_stack["draft"]] == [3]
    with pytest.raises(ValueError, match="the draft's 6 experts do not split evenly"):
        shard_experts(stacks(6), 4, 0)              # the target's 8 do
