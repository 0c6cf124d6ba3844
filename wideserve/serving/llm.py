"""The offline API: `LLM(model).generate(prompts, sampling_params)` and `.chat(messages)`.

The engine core runs in-process; this class tokenises, drives steps until every request is
done, and returns RequestOutputs in the order of the prompts.

Images (a model with a vision tower, docs/deepseek_v41.md "Images") come as vLLM takes them:
`generate({"prompt": ..., "multi_modal_data": {"image": PIL image or list}})` with one
`<｜deepseek_image｜>` placeholder in the text (or one image_token_id in `prompt_token_ids`)
per image, and `chat` messages with `image_url` (base64 data: URL) or `image_pil` parts. Both
expand the placeholders as the server does (serving/multimodal.py), so the same input gives
the server's tokens.
"""
from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Union

from tqdm.auto import tqdm

from wideserve.config import EngineConfig, engine_config_from_kwargs
from wideserve.engine.engine_core import EngineCore
from wideserve.serving.multimodal import (NO_IMAGES, ImageSupport, chat_message_images,
                                          expand_pieces, multi_modal_images, prepare_pil,
                                          split_prompt, split_token_ids)
from wideserve.serving.output_processor import OutputProcessor
from wideserve.types.multimodal import ImageInput
from wideserve.utils.extras import require_kv_connector
from wideserve.types.outputs import RequestOutput
from wideserve.types.sampling_params import SamplingParams
from wideserve.engine.spare_core import lend_spare_cores
from wideserve.utils.thread_governor import reading_now
from wideserve.utils.threads import ThreadPlan, plan_in_process
from wideserve.text.tokenizer import Tokenizer

PromptType = Union[str, Sequence[int], Mapping[str, Any]]
Message = Mapping[str, Any]
# (prompt text, token ids, image spans): what one prompt becomes.
Tokenized = tuple[Union[str, None], list[int], Union[list[ImageInput], None]]
logger = logging.getLogger(__name__)


def load_tokenizer(model_path, tokenizer: str | None) -> Tokenizer:
    if tokenizer is not None:
        return Tokenizer.from_pretrained(tokenizer)
    if model_path.is_file() and model_path.suffix == ".gguf":
        return Tokenizer.from_gguf(model_path)
    return Tokenizer.from_pretrained(model_path)


def _set_threads(threads: int | None) -> ThreadPlan:
    import torch
    plan = plan_in_process(threads, current=torch.get_num_threads())
    plan.apply()
    logger.info("LLM engine: %s", plan.describe())
    return plan


class LLM:
    """Engine arguments are the fields of LoadConfig, CacheConfig and SchedulerConfig
    (e.g. dtype, seed, load_format, max_model_len, max_num_seqs, max_num_batched_tokens,
    enable_prefix_caching, block_size, kv_cache_memory, policy) and ParallelConfig
    (data_parallel_size, enable_expert_parallel: N engine-core processes, docs/distributed.md;
    threads: torch threads per engine, default chosen for the machine, wideserve/utils/threads.py)."""

    def __init__(self, model: str | None = None, *, skip_tokenizer_init: bool = False,
                 **engine_args: Any) -> None:
        self._init(engine_config_from_kwargs(model=model, **engine_args), skip_tokenizer_init)

    @classmethod
    def from_engine_config(cls, config: EngineConfig,
                           skip_tokenizer_init: bool = False) -> "LLM":
        llm = cls.__new__(cls)
        llm._init(config, skip_tokenizer_init)
        return llm

    def _init(self, config: EngineConfig, skip_tokenizer_init: bool) -> None:
        require_kv_connector(config.kv_transfer)
        if config.parallel.enabled:
            # N ranks are N engine-core processes (wideserve/serving/dp_offline.py).
            from wideserve.serving.dp_offline import SyncDPEngine
            self.engine: Any = SyncDPEngine(config)
            self._governor = None           # each rank's process runs its own plan
            self._finalizer = weakref.finalize(self, self.engine.close)
            model_path = self.engine.model_path
        else:
            plan = _set_threads(config.parallel.threads)
            since = reading_now(plan.watched_cpus())
            self.engine = EngineCore(config)
            # The spare core lent while no other process uses it (utils/thread_governor.py).
            self._governor = lend_spare_cores(plan, self.engine, since)
            model_path = self.engine.loaded.path
        self._config = config
        self._images: ImageSupport | None | bool = False     # False: not looked up yet
        # Without a tokenizer prompts must be token ids and outputs carry no text.
        self.tokenizer = None if skip_tokenizer_init else \
            load_tokenizer(model_path, config.load.tokenizer)
        self.processor = OutputProcessor(self.tokenizer, stream=False)   # finished outputs only
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine processes now (data-parallel LLMs; otherwise a no-op). They also
        stop when this object is collected or the interpreter exits."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()

    def get_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("this LLM was created with skip_tokenizer_init=True")
        return self.tokenizer

    # ------------------------------------------------------------------------- generate
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None
                 ) -> list[RequestOutput]:
        prompt_list = self._as_prompt_list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompt_list))
        items = [self._tokenize(p) for p in prompt_list]
        return self._run(items, params, use_tqdm, priority)

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None, tools: list[dict] | None = None
             ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], Mapping) \
            else list(messages)
        tokenizer = self.get_tokenizer()
        items = []
        for conversation in conversations:
            rendered = [chat_message_images(m, i) for i, m in enumerate(conversation)]
            prompt = tokenizer.apply_chat_template(
                [m for m, _ in rendered], add_generation_prompt=add_generation_prompt,
                tools=tools, chat_template=chat_template)
            images = [im for _, ims in rendered for im in ims]
            # The template already holds the special tokens (bos included).
            items.append(self._with_images(prompt, None, images, add_special_tokens=False))
        params = self._params_per_prompt(sampling_params, len(items))
        return self._run(items, params, use_tqdm, None)

    # -------------------------------------------------------------------------- helpers
    @staticmethod
    def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, (str, Mapping)):
            return [prompts]
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]                     # one prompt given as token ids
        return list(prompts)

    @staticmethod
    def _params_per_prompt(sp: SamplingParams | Sequence[SamplingParams] | None,
                           n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} sampling_params for {n} prompts")
        return list(sp)

    def _tokenize(self, prompt: PromptType) -> Tokenized:
        if isinstance(prompt, str):
            return prompt, self.get_tokenizer().encode(prompt), None
        if isinstance(prompt, Mapping):
            if "multi_modal_data" in prompt:
                images = multi_modal_images(prompt["multi_modal_data"])
                token_ids = prompt.get("prompt_token_ids")
                if token_ids is None and "prompt" not in prompt:
                    raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
                return self._with_images(prompt.get("prompt"), token_ids, images,
                                         add_special_tokens=True)
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]], None
            if "prompt" in prompt:
                return prompt["prompt"], self.get_tokenizer().encode(prompt["prompt"]), None
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        return None, [int(t) for t in prompt], None

    def _image_support(self) -> ImageSupport | None:
        if self._images is False:
            self._images = ImageSupport.from_info(self.engine.model_info,
                                                  self._config.load.limit_mm_per_prompt.image)
        return self._images      # type: ignore[return-value]

    def _with_images(self, text: str | None, token_ids: Sequence[int] | None,
                     images: list[Any], add_special_tokens: bool) -> Tokenized:
        """A prompt and its images: each placeholder (the text's IMAGE_PLACEHOLDER, or one
        image_token_id in `token_ids`) expanded to its image's span, as the server does."""
        if not images:
            ids = list(token_ids) if token_ids is not None else \
                self.get_tokenizer().encode(text or "", add_special_tokens=add_special_tokens)
            return text, [int(t) for t in ids], None
        support = self._image_support()
        if support is None:
            raise ValueError(NO_IMAGES)
        support.check_count(len(images))
        if token_ids is not None:
            pieces = split_token_ids(token_ids, len(images), support.token_id)
        else:
            tokenizer = self.get_tokenizer()
            pieces = [tokenizer.encode(p, add_special_tokens=add_special_tokens and i == 0)
                      if p or i == 0 else []
                      for i, p in enumerate(split_prompt(text or "", len(images)))]
        prepared = [prepare_pil(im, support) for im in images]
        ids, spans = expand_pieces(pieces, prepared, support.token_id)
        return text, ids, spans

    def _run(self, items: list[Tokenized], params: list[SamplingParams],
             use_tqdm: bool, priority: Sequence[int] | None) -> list[RequestOutput]:
        ids = []
        added = []
        try:
            for i, ((text, token_ids, images), sp) in enumerate(zip(items, params)):
                rid = str(next(self._ids))
                core_reqs = self.processor.add_request(
                    rid, text, token_ids, sp, priority=priority[i] if priority else 0,
                    images=images)
                ids.append(rid)
                for req in core_reqs:
                    self.engine.add_request(req)
                    added.append(req.request_id)
        except Exception:
            self.engine.abort_requests(added)
            for rid in ids:
                self.processor.abort_request(rid)
            self._drain()
            raise
        return self._drive(ids, use_tqdm)

    def _drive(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        failed: dict[str, str] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                if self._governor is not None:
                    self._governor.tick()
                processed = self.processor.process_outputs(self.engine.step())
                failed.update(processed.failed)
                if processed.reqs_to_abort:
                    self.engine.abort_requests(processed.reqs_to_abort)
                for out in processed.request_outputs:
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
        if failed:
            raise RuntimeError(f"{len(failed)} request(s) failed: {next(iter(failed.values()))}")
        return [done[rid] for rid in ids]

    def _drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()
