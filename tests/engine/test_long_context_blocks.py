"""A 4,096-token request on a V4 config with a 128-token window (config B: CSA ratio 4, HCA
ratio 128): sliding-window groups hold only the window's pages while the compressed groups
grow as their ratios predict."""
from __future__ import annotations

import json
import math

from models import v4_configs
from wideserve.config import engine_config_from_kwargs
from wideserve.engine.engine_core import EngineCore
from wideserve.types.messages import EngineCoreRequest
from wideserve.types.sampling_params import SamplingParams

PROMPT = 4096


def test_window_groups_stay_bounded_while_compressed_groups_grow(tmp_path):
    cfg = {**v4_configs.B, "architectures": ["DeepseekV4ForCausalLM"],
           "model_type": "deepseek_v4", "max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    core = EngineCore(engine_config_from_kwargs(
        model=str(tmp_path), load_format="dummy", dtype="float32", block_size=256,
        max_num_batched_tokens=1024, max_num_seqs=4, kv_cache_memory=256 << 20))
    core.add_request(EngineCoreRequest("long", [2 + i % 250 for i in range(PROMPT)],
                                       SamplingParams(temperature=0.0, max_tokens=4,
                                                      ignore_eos=True)))
    request = core.scheduler.requests["long"]
    peak_live = [0] * len(core.kv_config.groups)
    while request.num_computed_tokens < PROMPT:
        core.step()
        for g, row in enumerate(core.kv_manager.block_ids("long")):
            peak_live[g] = max(peak_live[g], sum(1 for b in row if b != 0))
    core.step()     # the first decode step frees the pages the prefill left behind
    assert request.num_output_tokens == 2
    rows = core.kv_manager.block_ids("long")
    for g, group in enumerate(core.kv_config.groups):
        live = [b for b in rows[g] if b != 0]
        if group.is_sliding:
            # The next query reads positions 4096 - window + 1 .. 4096; a chunk of 1024 new
            # positions is written at once, so at most window + chunk positions are held.
            bound = math.ceil((group.spec.window + 1024) / group.block_size) + 1
            assert peak_live[g] <= bound, (group.spec.role, peak_live[g], bound)
            assert len(live) <= math.ceil(group.spec.window / group.block_size) + 1
        else:
            entries = (PROMPT + 1) // group.spec.compress_ratio
            assert len(live) == math.ceil((PROMPT + 1) / group.block_size)
            assert len(live) * group.entries_per_block >= entries
    while core.has_unfinished_requests():
        core.step()
    core.check_integrity()
    assert core.kv_manager.usage == 0.0
