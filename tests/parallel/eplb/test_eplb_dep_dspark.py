"""DeepSeek-V4.1 with its DSpark drafter across ranks (DEP2, real engine-core processes): the
drafter's MoE has its own expert count and top-k (4 experts top-3 against the target's 8
top-2), so each stack is sharded over the EP group on its own terms and one dispatcher serves
both. With EPLB rebalancing target and draft separately during decode, greedy outputs equal
one process's in fp32, with speculation on and off; and engines built, shut down and built
again in one process never hang and give the same outputs each time."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "models"))
import v41_helpers as h  # noqa: E402
from ep_harness import free_port_block  # noqa: E402

from wideserve import LLM, SamplingParams  # noqa: E402

# window 4, plan every 5 steps, two layers moved per step (the target's 6 in 3 steps, the
# draft's 3 in 2): several rebalances run during decode. 2 redundant: the target's 8 experts
# -> 10 slots (5 per rank), the draft's 4 -> 6 (3). Balancedness measured every 3 steps.
EPLB = {"window_size": 4, "step_interval": 5, "num_redundant_experts": 2,
        "layers_per_step": 2, "log_balancedness": True, "log_balancedness_interval": 3}
DSPARK = {"method": "dspark", "num_speculative_tokens": 4}
MAX_NEW = 20


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> dict:
    """Config B's target (8 experts, top-2) with a DSpark drafter of 4 experts, top-3."""
    kw = dict(h.CONFIGS["B"], dspark_n_routed_experts=4, dspark_num_experts_per_tok=3)
    path, _, _ = h.save_dspark_checkpoint(kw, tmp_path_factory.mktemp("v41_dspark_ep"))
    prompts = [h.random_tokens(n, seed=70 + n) for n in (5, 21, 34, 13, 9, 27)]
    return dict(path=str(path), prompts=prompts)


def _args(spec: bool, dp: int, port: int | None = None) -> dict:
    args: dict = dict(dtype="float32", block_size=16, kv_cache_memory=1 << 26,
                      skip_tokenizer_init=True)
    if spec:
        args["speculative_config"] = DSPARK
    if dp > 1:
        args.update(data_parallel_size=dp, enable_expert_parallel=True,
                    data_parallel_rpc_port=port or free_port_block(2 + 2 * dp),
                    dp_sync_timeout_s=60)
    return args


def _generate(ckpt: dict, dp: int, spec: bool, eplb: bool = False
              ) -> tuple[list[list[int]], dict]:
    args = _args(spec, dp)
    if eplb:
        args.update(enable_eplb=True, eplb_config=EPLB)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(ckpt["path"], **args)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in ckpt["prompts"]], sp,
                            use_tqdm=False)
        stats = {}
        if dp > 1:
            stats = _settled_stats(llm)
            llm.engine.check_integrity()        # every rank: KV and both stacks' slots
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], stats


def _settled_stats(llm: LLM) -> dict:
    """Once the ranks agree on the EPLB step count (the last outputs can reach us while a
    rank still finishes the group's final lock-step iteration)."""
    deadline = time.monotonic() + 60         # a deadline, not a count: a loaded machine
    while True:                              # may take seconds for that last iteration
        stats = llm.engine.get_stats()
        if "eplb" not in stats["per_rank"][0] or \
                len({r["eplb"]["target"]["steps"] for r in stats["per_rank"]}) == 1:
            return stats
        if time.monotonic() > deadline:
            return stats                     # the assertions then say what disagrees
        time.sleep(0.1)


@pytest.mark.parametrize("spec", [True, False], ids=["dspark", "no_spec"])
def test_dep2_dspark_eplb_equals_one_process(ckpt, spec):
    expected, _ = _generate(ckpt, 1, spec)
    got, stats = _generate(ckpt, 2, spec, eplb=True)
    assert got == expected
    ranks = stats["per_rank"]
    # Each stack sharded on its own terms: 5 target slots and 3 draft slots per rank.
    assert all(r["dp"]["num_local_experts_by_stack"] == {"target": 5, "draft": 3}
               for r in ranks)
    roles = {"target", "draft"} if spec else {"target"}
    assert set(ranks[0]["eplb"]) == roles
    for role in roles:
        per = [r["eplb"][role] for r in ranks]
        assert all(p["rebalances"] >= 2 for p in per), (role, per)
        assert len({p["rebalances"] for p in per}) == 1, "ranks disagree on the schedule"
        assert sum(p["bytes_sent"] for p in per) > 0, f"{role}: no weights moved"
        assert len({p["balancedness"] for p in per}) == 1 and 0 < per[0]["balancedness"] <= 1
        assert per[0]["balancedness_steps"] > 0
    drafted = sum((r.get("spec_decode") or {}).get("num_draft_tokens", 0) for r in ranks)
    assert (drafted > 0) == spec


_REBUILD = textwrap.dedent("""
    import json, sys, warnings
    from wideserve import LLM, SamplingParams
    path, prompts, args, rounds = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
    sp = SamplingParams(temperature=0.0, max_tokens={max_new}, ignore_eos=True)
    for _ in range(rounds):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            llm = LLM(path, **args)
        outs = llm.generate([{{"prompt_token_ids": p}} for p in prompts], sp, use_tqdm=False)
        llm.shutdown()
        print("ROUND", json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
""").format(max_new=MAX_NEW)


def test_dep2_dspark_built_shut_down_and_rebuilt_in_one_process(ckpt):
    """Three DEP2 + DSpark engines one after the other in one process, on the same ports (as
    with the default --data-parallel-rpc-port): each gives one process's outputs. The rounds
    run in a child process under a deadline, so a hang fails the test instead of stalling it."""
    expected, _ = _generate(ckpt, 1, True)
    args = _args(True, 2, port=free_port_block(6))
    run = subprocess.run(
        [sys.executable, "-c", _REBUILD, ckpt["path"], json.dumps(ckpt["prompts"]),
         json.dumps(args), "3"], capture_output=True, text=True, timeout=600)
    rounds = [json.loads(line.split(" ", 1)[1]) for line in run.stdout.splitlines()
              if line.startswith("ROUND ")]
    assert run.returncode == 0 and len(rounds) == 3, run.stderr[-4000:]
    assert all(r == expected for r in rounds)
