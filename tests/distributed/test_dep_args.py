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
