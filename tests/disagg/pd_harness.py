"""Two engine cores in one process joined by the loopback connector, and the colocated
reference: prefill on P (one output token, blocks held under a lease), decode on D with the
handle P returned, exactly the legs the router runs over HTTP."""
from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

from wideserve.config import engine_config_from_kwargs
from wideserve.engine.engine_core import EngineCore
from wideserve.types.messages import EngineCoreRequest
from wideserve.disagg.loopback import LoopbackHub
from wideserve.worker.model_loader import load_model
from wideserve.types.sampling_params import SamplingParams


def write_config(path: Path, cfg: dict) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def make_engines(model: str | None, *, load_format: str = "auto", hub: LoopbackHub | None = None,
                 p_kv: dict | None = None, d_kv: dict | None = None, **kw
                 ) -> tuple[EngineCore, EngineCore, EngineCore]:
    """(prefill, decode, colocated reference), sharing one set of weights."""
    args = dict(model=model, load_format=load_format, dtype="float32")
    args.update(kw)
    hub = hub or LoopbackHub()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_cfg = engine_config_from_kwargs(**args)
        loaded = load_model(ref_cfg.load)
        ref = EngineCore(ref_cfg, loaded)
        p = EngineCore(engine_config_from_kwargs(**args, kv_transfer_config={
            "kv_connector": "LoopbackConnector", "kv_role": "kv_producer", "engine_id": "P",
            **(p_kv or {})}), loaded, kv_hub=hub)
        d = EngineCore(engine_config_from_kwargs(**args, kv_transfer_config={
            "kv_connector": "LoopbackConnector", "kv_role": "kv_consumer", "engine_id": "D",
            **(d_kv or {})}), loaded, kv_hub=hub)
    return p, d, ref


def greedy(max_tokens: int, kv: dict | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          kv_transfer_params=kv)


def run_colocated(ref: EngineCore, prompts: list[list[int]], max_tokens: int
                  ) -> list[list[int]]:
    for i, p in enumerate(prompts):
        ref.add_request(EngineCoreRequest(f"r{i}", p, greedy(max_tokens)))
    outs = drain(ref, {f"r{i}" for i in range(len(prompts))})
    return [outs[f"r{i}"]["tokens"] for i in range(len(prompts))]


def drain(engine: EngineCore, ids: set[str], others: tuple[EngineCore, ...] = (),
          timeout: float = 120.0) -> dict[str, dict]:
    """Step `engine` (and `others`) until every id in `ids` has finished."""
    got: dict[str, dict] = {}
    done: set[str] = set()
    deadline = time.monotonic() + timeout
    while not ids <= done:
        assert time.monotonic() < deadline, f"not finished: {ids - done}"
        for e in others:
            if e.has_unfinished_requests():
                e.step()
        for out in engine.step():
            rec = got.setdefault(out.request_id, {"tokens": []})
            rec["tokens"] += out.new_token_ids
            if out.finished:
                done.add(out.request_id)
                rec.update(finish=out.finish_reason, error=out.error,
                           params=out.kv_transfer_params)
    return got


def prefill(p: EngineCore, prompts: list[list[int]], tag: str = "") -> list[dict]:
    for i, prompt in enumerate(prompts):
        p.add_request(EngineCoreRequest(f"p{tag}{i}", prompt,
                                        greedy(1, {"do_remote_decode": True})))
    outs = drain(p, {f"p{tag}{i}" for i in range(len(prompts))})
    return [outs[f"p{tag}{i}"]["params"] for i in range(len(prompts))]


def decode(d: EngineCore, p: EngineCore, prompts: list[list[int]], handles: list[dict],
           max_tokens: int, tag: str = "") -> dict[str, dict]:
    for i, (prompt, h) in enumerate(zip(prompts, handles)):
        d.add_request(EngineCoreRequest(f"d{tag}{i}", prompt, greedy(max_tokens, h)))
    return drain(d, {f"d{tag}{i}" for i in range(len(prompts))}, others=(p,))


def run_pd(p: EngineCore, d: EngineCore, prompts: list[list[int]], max_tokens: int,
           tag: str = "") -> list[list[int]]:
    handles = prefill(p, prompts, tag)
    assert all(h and h["do_remote_prefill"] for h in handles), handles
    outs = decode(d, p, prompts, handles, max_tokens, tag)
    for i in range(len(prompts)):
        assert outs[f"d{tag}{i}"]["finish"] == "length", outs[f"d{tag}{i}"]
    return [outs[f"d{tag}{i}"]["tokens"] for i in range(len(prompts))]


def settle(*engines: EngineCore, timeout: float = 10.0) -> None:
    """Step until no engine holds anything (leases released, loads stopped), then check the
    pools: free + cached + used == pool, and nothing used."""
    deadline = time.monotonic() + timeout
    for e in engines:
        while e.has_unfinished_requests():
            assert time.monotonic() < deadline, "engine never went idle"
            e.step()
        e.check_integrity()
        assert e.kv_manager.usage == 0.0, "blocks leaked"
