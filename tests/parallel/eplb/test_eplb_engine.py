"""EPLB inside the MoE layer and the engine, one process: redundant slots hold their experts'
weights, the router's choice is spread over them, greedy outputs do not change, and the
target and the draft (MTP) are tracked apart."""
from __future__ import annotations

import pytest
import torch

from wideserve.worker.eplb_balancer import EpGroup, ExpertBalancer
from wideserve.config.eplb import EplbConfig
from wideserve.layers.experts import RoutedExperts


def test_redundant_slots_hold_their_experts_and_outputs_do_not_change() -> None:
    torch.manual_seed(0)
    layer = RoutedExperts(4, 8, 8)
    with torch.no_grad():
        layer.gate_up_proj.normal_()
        layer.down_proj.normal_()
    x, ids = torch.randn(20, 8), torch.randint(0, 4, (20, 2))
    w = torch.rand(20, 2)
    want = layer(x, ids, w)
    cfg = EplbConfig(num_redundant_experts=4, window_size=4, step_interval=100)
    full = layer.gate_up_proj.detach().clone()
    bal = ExpertBalancer("target", [layer], 4, cfg, EpGroup(), torch.device("cpu"))
    assert layer.gate_up_proj.shape[0] == 8
    assert torch.equal(layer.gate_up_proj.detach(), full[torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])])
    torch.testing.assert_close(layer(x, ids, w), want, rtol=1e-6, atol=1e-6)
    assert int(layer.expert_load.sum()) == 40                  # recorded into the window's pass
    bal.step()
    assert int(bal.recorder.window_sum.sum()) == 40
    assert int(bal.recorder.window_sum[0, 4:].sum()) > 0       # the replicas got routings


def test_engine_with_redundant_experts_matches_and_tracks_target_and_draft() -> None:
    from wideserve.serving.llm import LLM
    from wideserve.types.sampling_params import SamplingParams
    prompts = ["ROMEO: what light", "JULIET: O Romeo, Romeo", "To be or not to be"]
    sp = SamplingParams(temperature=0, max_tokens=24)
    want = [o.outputs[0].token_ids for o in LLM().generate(prompts, sp)]
    llm = LLM(enable_eplb=True,
              eplb_config={"window_size": 8, "step_interval": 5, "num_redundant_experts": 4},
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == want
    stats = llm.engine.get_stats().eplb
    assert set(stats) == {"target", "draft"}
    balancers = llm.engine.eplb.balancers
    assert len(balancers["target"].layers) == 4 and len(balancers["draft"].layers) == 1
    for b in balancers.values():
        assert b.recorder.steps > 5 and int(b.recorder.window_sum.sum()) > 0
        assert b.layers[0].gate_up_proj.shape[0] == 12
    with pytest.raises(ValueError, match="enable_eplb"):
        LLM(eplb_config={"window_size": 8})


def test_balancedness_reaches_metrics_and_flags_parse() -> None:
    import argparse
    import dataclasses

    from prometheus_client import generate_latest

    from wideserve.engine.engine_core import EngineStats
    from wideserve.engine.engine_ipc import to_builtins
    from wideserve.worker.eplb_balancer import BalancerStats
    from wideserve.entrypoints.engine_args import add_engine_args, engine_config_from_args
    from wideserve.serving.openai.server_metrics import ServerMetrics
    eplb = {"target": BalancerStats(balancedness=0.5, rebalances=2),
            "draft": BalancerStats(balancedness=0.25)}
    stats = to_builtins(EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0,
                                    eplb={k: dataclasses.asdict(v) for k, v in eplb.items()}))
    text = generate_latest(ServerMetrics("m", lambda: stats).registry).decode()
    assert 'wideserve:eplb_balancedness{model_name="m",role="target"} 0.5' in text
    assert 'wideserve:eplb_balancedness{model_name="m",role="draft"} 0.25' in text
    assert 'wideserve:eplb_rebalances_total{model_name="m",role="target"} 2.0' in text
    plain = to_builtins(EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0))
    assert "eplb" not in generate_latest(ServerMetrics("m", lambda: plain).registry).decode()

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--enable-eplb", "--eplb-config",
                              '{"window_size": 1000, "step_interval": 3000, '
                              '"num_redundant_experts": 32, "log_balancedness": true}'])
    cfg = engine_config_from_args(args).eplb
    assert cfg.num_redundant_experts == 32 and cfg.log_balancedness
    assert engine_config_from_args(parser.parse_args([])).eplb is None
    with pytest.raises(ValueError, match="without --enable-eplb"):
        engine_config_from_args(parser.parse_args(["--eplb-config", "{}"]))
    parser.error = lambda message: (_ for _ in ()).throw(ValueError(message))  # type: ignore
    with pytest.raises(ValueError, match="unknown key 'window'"):
        parser.parse_args(["--enable-eplb", "--eplb-config", '{"window": 3}'])
