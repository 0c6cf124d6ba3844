"""The engine core: schedule -> execute -> sample -> update, one step at a time.

Token-level only (no text): the offline LLM and the server's front end tokenise and
detokenise. A step is written so several cores could run it in lock-step (one per
data-parallel rank): every input comes from the SchedulerOutput, every output is per request.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from wideserve.config import CacheConfig, EngineConfig
from wideserve.engine.engine_proc import EngineLoop
from wideserve.engine.errors import DuplicateRequestError, EngineStateError
from wideserve.kv_cache.groups import (KVCacheConfig, allocate_kv_tensors, build_kv_cache_config,
                                       exact_replay_tokens)
from wideserve.kv_cache.kv_cache_manager import KVCacheManager
from wideserve.kv_cache.spec import split_shared
from wideserve.layers.experts import RoutedExperts
from wideserve.layers.kv_quant import SPEC_FORMATS
from wideserve.types.messages import EngineCoreRequest, StepLogprobs
from wideserve.types.multimodal import ImageInput, check_images
from wideserve.types.sched_output import EngineCoreOutput, SchedulerOutput
from wideserve.engine.scheduler import Scheduler
from wideserve.engine.step_faults import poisons_device, step_error_message
from wideserve.engine.step_timer import StepStats, StepTimer
from wideserve.disagg.connector import KVConnector
from wideserve.worker.eplb_balancer import EpGroup
from wideserve.worker.eplb_manager import EplbManager
from wideserve.worker import lossless_choice, memory_profile, prefill_cap, weight_streaming
from wideserve.worker.decode_capture import (EagerReplay, capturable, capture_sizes,
                                             decode_capture_enabled)
from wideserve.worker.model_loader import LoadedModel, load_model
from wideserve.worker.model_runner import GroupLayout, ModelRunner
from wideserve.engine.step_worker import Worker
from wideserve.kernels import weight_stream
from wideserve.kernels.loader import cpu_ops_available
from wideserve.layers.kernel_table import kernel_summary
from wideserve.types.request import Request, RequestStatus, prompt_token_array
from wideserve.utils.threads import applied_plan
from wideserve.spec_decode.decoder import SpecDecoder
from wideserve.structured_outputs.manager import StructuredOutputManager
from wideserve.spec_decode.acceptance_metrics import SpecDecodeStats

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelInfo:
    name: str
    architecture: str
    max_model_len: int
    vocab_size: int
    num_params: int
    num_active_params: int
    kv_capacity_tokens: int | None
    eos_token_ids: list[int]
    dtype: str
    kv_block_size: int | None = None         # positions per logical (prefix-hash) block
    kernels: list[str] = field(default_factory=list)   # the startup block's kernel lines
    # Image inputs (docs/deepseek_v41.md, "Images"): the placeholder id and the vision config
    # the front end preprocesses with; None for a model that takes no images.
    image_token_id: int | None = None
    vision_config: dict[str, Any] | None = None


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    steps: StepStats = field(default_factory=StepStats)
    spec_decode: SpecDecodeStats | None = None      # None without speculative decoding
    kv_transfer: dict[str, Any] | None = None       # P/D connector counters (disagg/)
    dp: dict[str, Any] | None = None    # data-parallel rank stats (engine/dp_engine.py)
    eplb: dict | None = None                        # "target"/"draft" -> BalancerStats


def _zero_expert_load(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            module.expert_load.zero_()


def _model_max_len(config_json: dict) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        if isinstance(config_json.get(key), int):
            return int(config_json[key])
    return 4096


def _compile_model(model: torch.nn.Module, enforce_eager: bool | None,
                   device: torch.device) -> bool:
    """Compile the model's forward unless eager is asked for (LoadConfig.enforce_eager; None:
    eager on the CPU). Models without a compiled path (CausalLM.compile_forward returns
    False) stay eager."""
    eager = device.type == "cpu" if enforce_eager is None else enforce_eager
    if eager:
        return False
    if not model.compile_forward():
        logger.warning("%s has no compiled forward; running eagerly", type(model).__name__)
        return False
    return True


def _eos_token_ids(loaded: LoadedModel) -> list[int]:
    ids: list[int] = []
    sources = [loaded.config_json]
    gen = loaded.path / "generation_config.json" if loaded.path.is_dir() else None
    if gen is not None and gen.is_file():
        sources.insert(0, json.loads(gen.read_text()))
    for src in sources:
        eos = src.get("eos_token_id")
        for e in eos if isinstance(eos, list) else [eos]:
            if isinstance(e, int) and e not in ids:
                ids.append(e)
    return ids


class EngineCore:
    lockstep = False        # DEP ranks (engine/dp_engine.py) run steps in lock-step
    # A start-up warm-up step (`_warm_up`); off for data-parallel ranks, whose forward can
    # need their peers (expert parallelism) before the group is set up.
    warm_up_at_start = True
    # The engine process's loop for it (engine/engine_proc.py LoopEngine); DPEngineCore's own.
    loop_class: type[EngineLoop] = EngineLoop

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 kv_hub: Any = None) -> None:
        """kv_hub: the in-process LoopbackHub for the LoopbackConnector (tests)."""
        self.config = config
        self.loaded = loaded or load_model(config.load)
        self.model = self.loaded.model.eval()
        self.model.apply_kernel_config(config.kernels)       # the per-engine CPU-op switches
        replay = config.load.decoder_bounded_replay
        if replay or (replay is None and self.model.supports_decoder_bounded_replay):
            self.model.enable_decoder_bounded_replay()
        self.device = torch.device(config.load.device)
        if self.device.type == "cpu":
            # Build or load the C++ CPU kernels now, inside startup's deadline, not in the
            # first step, where a first build would outlast the engine's heartbeat.
            cpu_ops_available()
        self.compiled = _compile_model(self.model, config.load.enforce_eager, self.device)
        model_len = _model_max_len(self.loaded.config_json)
        self.max_model_len = config.scheduler.max_model_len or model_len
        if self.max_model_len > model_len:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"limit of {model_len} positions")
        self.eos_token_ids = _eos_token_ids(self.loaded)
        self.vocab_size = int(self.model.compute_logits(
            torch.zeros(1, self._hidden_size(), dtype=self.loaded.dtype,
                        device=self.device)).shape[-1])
        self.spec: SpecDecoder | None = None
        self.scheduler_config = config.scheduler
        if config.speculative is not None:
            self.spec = SpecDecoder(config.speculative, self.model, config.load,
                                    self.vocab_size, self.max_model_len)
            lookahead = max(config.scheduler.num_lookahead_tokens,
                            self.spec.num_lookahead_tokens)
            self.scheduler_config = dataclasses.replace(config.scheduler,
                                                        num_lookahead_tokens=lookahead)
        # Before the KV cache: redundant expert slots take memory first.
        self.eplb = (EplbManager(config.eplb, self.model, self.spec, self.device,
                                 self._ep_group()) if config.eplb is not None else None)
        self.memory_report: memory_profile.MemoryProfile | None = None   # set by _profiled
        self.kv_config, self.kv_manager = self._build_kv_cache()
        self.kv_caches = allocate_kv_tensors(self.kv_config, self.device,
                                             config.cache.kv_huge_pages)
        logger.info("%s", self.kv_config.summary())
        self.kv_connector = KVConnector(config.kv_transfer, self.kv_config, self.kv_caches,
                                        kv_hub) if config.kv_transfer is not None else None
        self.scheduler = Scheduler(
            self.scheduler_config, self.kv_manager, self.max_model_len,
            eos_token_id_fallback=tuple(self.eos_token_ids),
            kv_connector=self.kv_connector.scheduler if self.kv_connector else None)
        layouts = [GroupLayout(g.block_size, g.compress_ratio) for g in self.kv_config.groups]
        self.runner = ModelRunner(self.model, layouts, self.kv_config.cache_group,
                                  self.kv_caches, self.device, with_drafts=self.spec is not None)
        if self.spec is not None:
            self.spec.bind(self.runner, self.kv_config, self.kv_caches)
        self._enable_decode_capture()
        # Off with EPLB: moved experts would be rewritten under a kept plan's packed weights.
        self.runner.enable_small_batch(
            0 if self.eplb is not None else config.load.small_batch_decode,
            config.load.small_batch_gemms)
        self.runner.enable_decode_batch(
            self.scheduler_config.max_num_seqs
            if config.load.persistent_decode_batch and self.eplb is None else 0)
        self.structured = StructuredOutputManager(
            config.load.tokenizer or self.loaded.path, self.eos_token_ids, self.vocab_size,
            self.device)
        self._generation_tokens = 0
        self.timer = StepTimer(self.device, enabled=config.load.step_timing)
        # Step inputs, forward, sampling and the per-request execution state.
        self.worker = Worker(self.runner, self.kv_manager, self.structured, self.spec,
                             self.vocab_size, self.eos_token_ids, self.timer,
                             cpu_argmax=config.kernels.cpu_argmax)
        self._broken: str | None = None     # why the state cannot be trusted (step_faults)
        warms_up = self.warm_up_at_start and self._first_use_work()
        if warms_up and self.memory_report is None:
            self._warm_up()
        self._resolve_lossless_experts(measure=warms_up)
        self._resolve_weight_streaming(measure=warms_up)
        self._resolve_prefill_cap(measure=warms_up)

    # ------------------------------------------------------------------------- setup
    def _first_use_work(self) -> bool:
        """Whether a first forward does work a later one does not: packing bf16 weights for
        the CPU kernels and timing them (kernels/choice.py). Elsewhere (fp32, an accelerator)
        a warm-up step would only add its own time to every start (~0.3 s of CPU on the
        bundled model; the test suite starts hundreds of engines)."""
        return self.device.type == "cpu" and self.loaded.dtype == torch.bfloat16

    def _warm_up(self) -> None:
        """A throwaway prefill + decode (worker/memory_profile.py run_warm_up), so the first
        request's step packs no weights and times no kernels: that first-use work took
        longer than the front end's stall timeout on a loaded machine and got a server
        killed at its first request. (A maximal memory-profile step, where one ran, did the
        same already.)"""
        t = time.perf_counter()
        memory_profile.run_warm_up(self.model, self._kv_specs(), self.config.cache,
                                   self.scheduler_config, self.max_model_len, self.device)
        _zero_expert_load(self.model)      # the warm-up's routing is not real load
        logger.info("warm-up step (packed weights, kernel plans) in %.2f s",
                    time.perf_counter() - t)

    def _resolve_lossless_experts(self, measure: bool) -> None:
        """KernelConfig.lossless_experts (worker/lossless_choice.py): "auto" timed here where
        the warm-up runs; the form not kept is freed."""
        if self.device.type != "cpu":
            return
        decision = lossless_choice.resolve(
            self.config.kernels.lossless_experts, self.model, self.loaded.dtype,
            measure and not self.config.parallel.enabled,
            lambda lengths: memory_profile.timed_prefill(
                self.model, self._kv_specs(), self.config.cache, self.scheduler_config,
                self.max_model_len, self.device, lengths, self.vocab_size),
            self.scheduler_config)
        _zero_expert_load(self.model)          # the timed steps' routing is not real load
        logger.info("lossless experts: %s", decision.note)

    def _resolve_weight_streaming(self, measure: bool) -> None:
        """ParallelConfig.weight_streaming (worker/weight_streaming.py): the helper thread
        started or stopped for this process; "auto" timed here where the warm-up runs."""
        if self.device.type != "cpu":
            return
        idle, cpus = weight_streaming.idle_cores(applied_plan(), torch.get_num_threads())
        ops = cpu_ops_available()
        decision = weight_streaming.decide(
            self.config.parallel.weight_streaming, ops, weight_stream.demotes(), idle, cpus,
            measure and not self.config.parallel.enabled,
            lambda: weight_streaming.measure(self.model, self._kv_specs(), self.config.cache,
                                             self.scheduler_config, self.max_model_len,
                                             self.device, self.vocab_size, cpus))
        _zero_expert_load(self.model)          # the timed steps' routing is not real load
        if decision.on:
            weight_stream.start(decision.cpus)
        elif ops:
            weight_stream.stop()
        logger.info("weight streaming: %s%s", decision.note,
                    f", helper {weight_streaming.where(decision.cpus)}" if decision.on else "")

    def _resolve_prefill_cap(self, measure: bool) -> None:
        """SchedulerConfig.max_prefill_tokens "auto": timed here where the warm-up runs
        (worker/prefill_cap.py), else no cap."""
        sched = self.scheduler_config
        if sched.max_prefill_tokens != "auto":
            return
        cap, note = 0, "not measured here (only one CPU engine with bf16 weights measures it)"
        if measure:
            t = time.perf_counter()
            times = prefill_cap.measure(self.model, self._kv_specs(), self.config.cache,
                                        sched, self.max_model_len, self.device,
                                        self.vocab_size)
            _zero_expert_load(self.model)      # the timed steps' routing is not real load
            cap = prefill_cap.choose_cap(times, sched.max_num_batched_tokens)
            steps = ", ".join(f"{n}: {s * 1e3:.1f}" for n, s in sorted(times.items()))
            note = f"step ms per prompt tokens {steps}; measured in " \
                   f"{time.perf_counter() - t:.1f} s"
        self.scheduler_config = dataclasses.replace(sched, max_prefill_tokens=cap)
        self.scheduler.config = self.scheduler_config
        logger.info("prefill cap: %s (%s)", f"{cap} tokens per step" if cap else "none", note)

    def _ep_group(self) -> EpGroup:
        """The expert-parallel group EPLB balances over: one process here."""
        return EpGroup()

    def _enable_decode_capture(self) -> None:
        """The captured decode step (LoadConfig.decode_capture). Off with EPLB: padded rows
        would count as expert load. With speculation replays stay eager (a graph would skip
        the proposers' Python side)."""
        load = self.config.load
        if not decode_capture_enabled(load.enforce_eager, load.decode_capture, self.device,
                                      capturable(self.model, self.device)):
            return
        if self.eplb is not None:
            logger.info("captured decode step off: EPLB counts every routed row")
            return
        sizes = capture_sizes(self.scheduler_config.max_num_seqs)
        capturer = EagerReplay() if self.spec is not None else None
        self.runner.enable_decode_capture(
            sizes, self.max_model_len + self.scheduler_config.num_lookahead_tokens, capturer)

    def _hidden_size(self) -> int:
        cfg = self.loaded.config_json
        text = cfg.get("text_config") or {}     # nested (multimodal) configs, e.g. V4.1
        return int(cfg.get("hidden_size") or text.get("hidden_size") or cfg["n_embd"])

    def _kv_specs(self) -> dict:
        kv_dtype = self.config.cache.kv_cache_dtype
        specs = self.model.kv_cache_specs(kv_dtype)
        if self.spec is not None:
            specs = {**specs, **self.spec.kv_cache_specs(kv_dtype)}
        return specs

    def _build_kv_cache(self) -> tuple[KVCacheConfig, KVCacheManager]:
        cache, sched = self.config.cache, self.scheduler_config
        specs = self._kv_specs()
        unsupported = sorted({s.record_format for s in split_shared(specs)[0].values()
                              if s.record_format != "raw" and s.record_format not in SPEC_FORMATS})
        if unsupported:
            raise ValueError(f"--kv-cache-dtype {cache.kv_cache_dtype}: storing KV records as "
                             f"{', '.join(unsupported)} is not supported for execution; "
                             f"use auto or bf16")
        cache = self._profiled(cache, specs)
        kv_config = build_kv_cache_config(specs, cache, sched, device=self.device,
                                          max_model_len=self.max_model_len)
        replay = 0
        if cache.enable_prefix_caching and cache.prefix_window_mode == "replay":
            depth = self.model.replay_depth
            replay = exact_replay_tokens(specs, len(kv_config.groups) if depth is None
                                         else depth)
        manager = KVCacheManager(kv_config, cache, self.max_model_len, replay_tokens=replay)
        return kv_config, manager

    def _profiled(self, cache: CacheConfig, specs: dict) -> CacheConfig:
        """On an accelerator with memory statistics and no explicit KV size: the KV budget
        after a maximal dummy step's activations (worker/memory_profile.py)."""
        probe = memory_profile.DeviceMemory.for_device(self.device)
        if probe is None or cache.kv_cache_memory is not None \
                or cache.num_blocks_override is not None:
            return cache
        profile = memory_profile.profile_kv_budget(
            probe, cache.gpu_memory_utilization,
            lambda: memory_profile.run_dummy_step(self.model, specs, cache,
                                                  self.scheduler_config, self.max_model_len,
                                                  self.device))
        _zero_expert_load(self.model)      # the dummy step's routing is not real load
        gib = 1 << 30
        logger.info("memory profile: %.2f GiB total, %.2f GiB in use after loading, %.2f GiB "
                    "peak activations for a maximal step -> %.2f GiB for the KV cache",
                    profile.total / gib, profile.used_before / gib,
                    profile.activation_peak / gib, profile.budget / gib)
        self.memory_report = profile
        return dataclasses.replace(cache, kv_cache_memory=profile.budget)

    @property
    def model_info(self) -> ModelInfo:
        total, active = self.model.param_counts()
        arch = (self.loaded.config_json.get("architectures") or
                [self.loaded.config_json.get("model_type", "?")])[0]
        return ModelInfo(
            name=str(self.config.load.model or self.loaded.path.name), architecture=arch,
            max_model_len=self.max_model_len, vocab_size=self.vocab_size, num_params=total,
            num_active_params=active, kv_capacity_tokens=self.kv_config.capacity_tokens,
            eos_token_ids=list(self.eos_token_ids), dtype=str(self.loaded.dtype).split(".")[-1],
            kv_block_size=self.kv_config.block_size,
            kernels=kernel_summary(self.model, self.loaded.dtype, self.device.type),
            image_token_id=self.model.image_token_id,
            vision_config=(dataclasses.asdict(self.model.config.vision)
                           if self.model.image_token_id is not None else None))

    # ---------------------------------------------------------------------- requests
    def _check_images(self, images: list[ImageInput], prompt_len: int) -> None:
        """The model takes images, at most --limit-mm-per-prompt of them, on image spans."""
        if self.model.image_token_id is None:
            raise ValueError("this model takes no image inputs (no vision tower, or served "
                             "with --limit-mm-per-prompt image=0)")
        limit = self.config.load.limit_mm_per_prompt.image
        if len(images) > limit:
            raise ValueError(f"the prompt has {len(images)} images; at most {limit} per "
                             f"prompt (--limit-mm-per-prompt)")
        check_images(images, prompt_len)

    def add_request(self, req: EngineCoreRequest) -> None:
        self._check_usable()
        if req.request_id in self.scheduler.requests:
            # Before any per-request state is set: the live request keeps its own.
            raise DuplicateRequestError(f"request_id {req.request_id!r} is already in use")
        # The prompt's int32 buffer serves every whole-prompt check; one that came as int32
        # bytes (engine IPC) is read in place, no per-token work (docs/host_path.md).
        prompt = prompt_token_array(req.prompt_token_ids)
        n = len(prompt)
        if n == 0:
            raise ValueError("the prompt is empty")
        try:
            request = Request(req.request_id, prompt, req.sampling_params,
                              arrival_time=req.arrival_time, priority=req.priority,
                              group_id=req.group_id,
                              kv_transfer_params=req.sampling_params.kv_transfer_params,
                              images=req.images or None)
        except ValueError as e:
            raise ValueError(f"a prompt token id is outside the vocabulary "
                             f"[0, {self.vocab_size}) ({e})") from None
        ids = request.prompt_array()
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.vocab_size:
            raise ValueError(f"prompt token id {lo if lo < 0 else hi} is outside the "
                             f"vocabulary [0, {self.vocab_size})")
        if req.images:
            self._check_images(req.images, n)
        max_tokens = req.sampling_params.max_tokens or 1
        if n + max_tokens > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"request has {n} prompt tokens and asks for {max_tokens} more")
        self._check_kv_transfer_params(req, ids)
        self.worker.add_request(req.request_id, req.sampling_params)
        if not self.structured.hold(request):       # else: scheduled once its grammar is ready
            self.scheduler.add_request(request)

    def _check_kv_transfer_params(self, req: EngineCoreRequest, prompt_ids: np.ndarray) -> None:
        params = req.sampling_params.kv_transfer_params
        if not params or not (params.get("do_remote_prefill") or params.get("do_remote_decode")):
            return
        if self.kv_connector is None:
            raise ValueError("kv_transfer_params: this server runs without "
                             "--kv-transfer-config (no P/D disaggregation)")
        problem = self.kv_connector.scheduler.validate(params, prompt_ids, req.images)
        if problem is not None:
            raise ValueError(problem)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.structured.drop(request_ids)
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_requests() or self.structured.has_pending

    def has_live_requests(self) -> bool:
        """Requests running, waiting or compiling a grammar (not the bookkeeping step owed
        after the last one finished): the engine loop's idle test, engine/engine_proc.py."""
        return self.scheduler.has_unfinished_requests() or self.structured.has_pending

    def _admit_structured(self) -> list[EngineCoreOutput]:
        """Requests whose grammar compiled join the scheduler; failed ones end in an error."""
        for request in self.structured.ready(0.0 if self.scheduler.has_requests() else 0.01):
            self.scheduler.add_request(request)
        return [EngineCoreOutput(request_id=rid, finish_reason="error", error=why)
                for rid, why in self.structured.take_failures().items()]

    def _end_failed_constraints(self, sampled: dict[str, list[int]]) -> dict[str, str]:
        """Requests whose output constraint failed during this step end with an error; the
        tokens sampled for them (unconstrained, or refused) are not emitted."""
        failed = self.structured.take_failures()
        for rid in failed:
            sampled.pop(rid, None)
        if failed:
            self.scheduler.finish_requests(list(failed), RequestStatus.FINISHED_ERROR)
        return failed

    def request_ids(self) -> list[str]:
        """Every request this engine still owes an answer: the scheduler's and those held
        for their grammar (a front end that waits on a request no rank knows names it)."""
        return [*self.scheduler.requests, *self.structured.pending_ids]

    def check_integrity(self) -> None:
        self.kv_manager.check_integrity()
        if self.eplb is not None:
            self.eplb.verify_weights()      # expert slots hold what the maps say

    # -------------------------------------------------------------------------- step
    def step(self) -> list[EngineCoreOutput]:
        self._check_usable()
        timer = self.timer
        timer.start()
        if self.kv_connector is not None:
            self.kv_connector.finish_step()
        grammar_errors = self._admit_structured()
        try:
            sched_out = self.scheduler.schedule()
        except Exception as e:
            raise self._broken_by("scheduling", e) from e
        if self.kv_connector is not None:
            self.kv_connector.start_step(sched_out)
        self.structured.drop(sched_out.finished_req_ids)
        self.worker.drop(sched_out.finished_req_ids, sched_out.preempted_req_ids)
        timer.mark("schedule")
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, object] | None = None
        if not sched_out.is_empty:
            try:
                sampled, logprobs = self._execute(sched_out)
            except Exception as e:  # noqa: BLE001 - fail this step's requests, keep serving
                self.structured.take_failures()     # its requests end with the step's error
                return self._fail_step(sched_out, e) + grammar_errors
            if self.eplb is not None and not self.lockstep:
                self.eplb.step()        # lock-step ranks step EPLB after the whole step
        failed = self._end_failed_constraints(sampled)
        try:
            outputs = self.scheduler.update_from_output(sched_out, sampled, logprobs)
        except Exception as e:
            raise self._broken_by("the scheduler's update", e) from e
        for out in outputs if failed else ():
            if out.request_id in failed:
                out.error, out.internal_error = failed[out.request_id], True
        outputs.extend(grammar_errors)
        self.worker.commit(sched_out)
        self._generation_tokens += sum([len(out.new_token_ids) for out in outputs])
        timer.mark("output")
        timer.finish(sched_out.num_batched_tokens, len(sched_out.scheduled))
        return outputs

    # ---------------------------------------------------------------- failed steps
    def _fail_step(self, sched_out: SchedulerOutput,
                   error: Exception) -> list[EngineCoreOutput]:
        """Execution failed: the step's requests end with the error, the rest go on
        (engine/step_faults.py). Raises EngineStateError when the state cannot be trusted."""
        if poisons_device(error):
            raise self._broken_by("execution (the device is unusable)", error) from error
        logger.exception("engine step failed; failing its %d request(s), serving the rest",
                         len(sched_out.scheduled))
        outputs = self.scheduler.fail_step(sched_out, step_error_message(error))
        try:
            self.kv_manager.check_integrity()
        except AssertionError as bad:
            raise self._broken_by("execution (KV cache inconsistent afterwards)", bad) from error
        self.timer.finish(0, 0)
        return outputs

    def _broken_by(self, where: str, error: BaseException) -> EngineStateError:
        self._broken = f"engine state cannot be trusted after a failure in {where}: " \
            f"{type(error).__name__}: {error}"
        logger.error("%s", self._broken)
        return EngineStateError(self._broken)

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise EngineStateError(self._broken)

    def _execute(self, sched_out: SchedulerOutput
                 ) -> tuple[dict[str, list[int]], dict[str, StepLogprobs] | None]:
        """The step's forward and sampling: the worker's (engine/step_worker.py)."""
        return self.worker.execute(sched_out)

    # ------------------------------------------------------------------------- stats
    def get_stats(self) -> EngineStats:
        kv = self.kv_manager
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            kv_usage=kv.usage, prefix_queries=kv.stats.queries, prefix_hits=kv.stats.hits,
            num_preemptions=self.scheduler.make_stats().num_preemptions,
            prompt_tokens=self.worker.prompt_tokens, generation_tokens=self._generation_tokens,
            steps=self.timer.stats,
            spec_decode=self.spec.stats.snapshot() if self.spec is not None else None,
            kv_transfer=self.kv_connector.scheduler.snapshot() if self.kv_connector else None,
            eplb=self.eplb.stats() if self.eplb is not None else None)

