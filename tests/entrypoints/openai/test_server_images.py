"""Image inputs through the real server (serving/openai/images.py) and the offline LLM
(serving/llm.py): a tiny random DeepSeek-V4.1 with a 2-layer vision tower (dummy weights),
`--limit-mm-per-prompt image=1`.
- chat: an image_url data: URL is served: the placeholder expanded to the image's span where
  the part was, the tokens equal the in-process engine's on those ids and that image;
- offline: LLM.chat (image_url / image_pil parts) and LLM.generate (vLLM's multi_modal_data,
  text or token prompt) give the server's tokens for the same input;
- Anthropic Messages (the real `anthropic` SDK): a base64 image block gives chat's output,
  count_tokens counts the span; url sources and bad images are 400s;
- /v1/completions takes no images: a 400 pointing to chat;
- P/D: router (in-process) -> this server as the prefill instance -> a decode instance over
  NIXL: a chat image gives the one-server greedy tokens, the image rows' KV pulled;
- a remote URL, bad base64, bytes that are no image, and two images over the limit are 400s
  with a message naming the cause (ValueErrors offline); text-only chat is unaffected.
(A model without a vision tower refusing images: test_server_bad_inputs.py; P/D with an
image on two engine cores, no tower run on decode: tests/disagg/test_pd_loopback.py.)"""
from __future__ import annotations

import base64
import io
import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import numpy as np
import pytest
from models import v41_helpers as h
from oai_server_utils import RemoteServer

VISION = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=48,
              patch_size=4, downsample_ratio=2, max_image_tokens=64, min_pixels=256)
IMAGE_ID = h.VOCAB - 2
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def _model(path):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
        "text_config": dict(h.B), "vision_config": VISION, "image_token_id": IMAGE_ID,
        "torch_dtype": "float32", "max_position_embeddings": 4096}))
    h.tokenizer(h.VOCAB).backend_tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return path


def _png(seed: int) -> bytes:
    from PIL import Image
    pixels = np.random.default_rng(seed).integers(0, 256, (13, 22, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG")
    return out.getvalue()


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


KV_SECRET = "images-pd-secret-0123456789abcdef"
PD_ENV = dict(WIDESERVE_KV_SECRET=KV_SECRET, UCX_NET_DEVICES="lo", UCX_MODULES="^ib")


def _serve(path, role: str, *extra: str) -> RemoteServer:
    kv = json.dumps({"kv_connector": "NixlConnector", "kv_role": role})
    return RemoteServer([str(path), "--load-format", "dummy", "--dtype", "float32",
                         "--kv-cache-dtype", "bf16", "--max-model-len", "256",
                         "--kv-cache-memory", "64MiB", "--limit-mm-per-prompt", "image=1",
                         "--kv-transfer-config", kv, *extra])


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The one server of every test here, which is also the prefill instance of the P/D test
    (a producer serves plain requests as any server does), the decode instance, and the
    in-process LLM: the servers start side by side while the LLM loads."""
    from wideserve.serving.llm import LLM
    path = _model(tmp_path_factory.mktemp("v41_images"))
    with pytest.MonkeyPatch.context() as mp, ThreadPoolExecutor(2) as pool:
        for k, v in PD_ENV.items():
            mp.setenv(k, v)
        futures = [pool.submit(_serve, path, "kv_producer"),
                   pool.submit(_serve, path, "kv_consumer", "--enable-debug-endpoints")]
        try:
            llm = LLM(str(path), load_format="dummy", dtype="float32", kv_cache_dtype="bf16",
                      max_model_len=256, kv_cache_memory=64 << 20,
                      limit_mm_per_prompt={"image": 1})
            servers = [f.result() for f in futures]
        except BaseException:
            for f in futures:
                if f.exception() is None:
                    f.result().close()
            raise
    try:
        yield servers[0], path, servers[1], llm
    finally:
        for srv in servers:
            srv.close()


@pytest.fixture(scope="module")
def server(stack):
    return stack[0], stack[1]


@pytest.fixture(scope="module")
def llm(stack):
    return stack[3]


def _chat(srv, content, **kw) -> httpx.Response:
    body = {"model": srv.url and None, "messages": [{"role": "user", "content": content}],
            "max_tokens": 3, "temperature": 0.0, "ignore_eos": True, **kw}
    body.pop("model")
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)


def test_image_chat_equals_the_engine_on_the_expanded_prompt(server, llm):
    from wideserve.models.deepseek_v41.config import DeepseekV41VisionConfig
    from wideserve.models.deepseek_v41.vision import decode_image, image_input, prepare_image
    from wideserve.types.messages import EngineCoreRequest
    from wideserve.types.sampling_params import SamplingParams
    srv, path = server
    r = _chat(srv, [{"type": "text", "text": "t5 t6 t7"}, _image(_url(_png(1))),
                    {"type": "text", "text": " t8 t9"}],
              logprobs=True, return_tokens_as_token_ids=True)
    assert r.status_code == 200, r.text
    got = [int(t["token"].split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["content"]]
    prepared = prepare_image(decode_image(_png(1)), DeepseekV41VisionConfig.from_dict(VISION))
    image = image_input(prepared, 3)
    ids = [5, 6, 7] + [IMAGE_ID] * image.length + [8, 9]
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    core = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    want: dict[str, list[int]] = {"img": [], "txt": []}
    core.add_request(EngineCoreRequest("img", ids, params, images=[image]))
    core.add_request(EngineCoreRequest("txt", ids, params))       # the same ids as text
    while core.has_unfinished_requests():
        for o in core.step():
            want[o.request_id] += o.new_token_ids
    assert got == want["img"] != want["txt"]
    other = _chat(srv, [{"type": "text", "text": "t5 t6 t7"}, _image(_url(_png(2))),
                        {"type": "text", "text": " t8 t9"}])
    assert other.status_code == 200, other.text
    text = _chat(srv, "t5 t6 t7 t8 t9")
    assert text.status_code == 200 and text.json()["usage"]["prompt_tokens"] == 5


@pytest.mark.parametrize("content,needle", [
    ([_image("https://example.com/cat.png")], "does not fetch"),
    ([_image("data:image/png;base64,@@not-base64@@")], "not valid base64"),
    ([_image(_url(b"these bytes are no image"))], "cannot be decoded"),
    ([_image("data:image/png,rawbytes")], "base64 data: URL"),
    ([_image(_url(_png(1))), _image(_url(_png(2)))], "at most 1 per prompt"),
], ids=["remote", "bad-base64", "not-an-image", "not-base64-url", "over-limit"])
def test_bad_images_are_400s(server, content, needle):
    r = _chat(server[0], content)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


CONTENT = [{"type": "text", "text": "t5 t6 t7"}, {"type": "image_url"},
           {"type": "text", "text": " t8 t9"}]
PROMPT = "t5 t6 t7<｜deepseek_image｜> t8 t9 "        # CONTENT as TEMPLATE renders it


def _content(image_part: dict) -> list[dict]:
    return [image_part if p["type"] == "image_url" else p for p in CONTENT]


def _pil(seed: int):
    from wideserve.models.deepseek_v41.vision import decode_image
    return decode_image(_png(seed))


def _server_tokens(srv, seed: int = 1) -> tuple[list[int], dict]:
    r = _chat(srv, _content(_image(_url(_png(seed)))), logprobs=True,
              return_tokens_as_token_ids=True)
    assert r.status_code == 200, r.text
    body = r.json()
    return [int(t["token"].split(":")[1])
            for t in body["choices"][0]["logprobs"]["content"]], body


def test_offline_llm_images_equal_the_server(server, llm):
    """LLM.chat (image_url and image_pil parts) and LLM.generate (multi_modal_data with a
    text prompt holding the placeholder, or a token prompt holding image_token_id once)
    give the server's greedy tokens for the same image; another image changes them."""
    from wideserve.types.sampling_params import SamplingParams
    want, _ = _server_tokens(server[0])
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    msgs = [[{"role": "user", "content": _content(_image(_url(_png(1))))}],
            [{"role": "user", "content": _content({"type": "image_pil",
                                                   "image_pil": _pil(1)})}]]
    outs = llm.chat(msgs, sp, use_tqdm=False)
    outs += llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": _pil(1)}},
                          {"prompt_token_ids": [5, 6, 7, IMAGE_ID, 8, 9],
                           "multi_modal_data": {"image": [_pil(1)]}},
                          {"prompt": PROMPT, "multi_modal_data": {"image": _pil(2)}}],
                         sp, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got[:4] == [want] * 4 and got[4] != want
    assert len(outs[0].prompt_token_ids) == len(outs[3].prompt_token_ids) > 6


@pytest.mark.parametrize("prompt,needle", [
    ({"prompt": "t5 t6", "multi_modal_data": {"image": "x"}}, "image placeholders"),
    ({"prompt": PROMPT, "multi_modal_data": {"image": "x"}}, "must be a PIL.Image"),
    ({"prompt": PROMPT, "multi_modal_data": {"video": "x"}}, "takes 'image' only"),
    ({"prompt": PROMPT + PROMPT, "multi_modal_data": {"image": ["a", "b"]}},
     "at most 1 per prompt"),
    ([{"role": "user", "content": _content(_image("https://example.com/cat.png"))}],
     "does not fetch"),
], ids=["no-placeholder", "not-pil", "video", "over-limit", "remote-url"])
def test_offline_bad_images_are_value_errors(llm, prompt, needle):
    from wideserve.types.sampling_params import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=1)
    run = llm.chat if isinstance(prompt, list) else llm.generate
    with pytest.raises(ValueError, match=needle):
        run(prompt, sp, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def _b64_block(data: bytes, media: str = "image/png") -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": media,
                                        "data": base64.b64encode(data).decode()}}


def test_anthropic_image_blocks_equal_chat(server):
    """The real anthropic SDK: a base64 image block between text blocks is chat's image_url
    part (same prompt tokens, same greedy text, streamed or not); count_tokens counts the
    image's span; an image in a tool_result is served too."""
    srv = server[0]
    _, chat = _server_tokens(srv)
    client = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "t5 t6 t7"}, _b64_block(_png(1)),
        {"type": "text", "text": " t8 t9"}]}]
    model = chat["model"]
    msg = client.messages.create(model=model, max_tokens=3, messages=messages,
                                 extra_body={"temperature": 0.0})
    assert msg.content[0].text == chat["choices"][0]["message"]["content"]
    with client.messages.stream(model=model, max_tokens=3, messages=messages,
                                extra_body={"temperature": 0.0}) as stream:
        assert "".join(stream.text_stream) == msg.content[0].text
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == \
        chat["usage"]["prompt_tokens"]
    assert client.messages.count_tokens(model=model, messages=messages).input_tokens == \
        chat["usage"]["prompt_tokens"]
    tool_turn = [{"role": "user", "content": "t1"},
                 {"role": "assistant", "content": [{"type": "tool_use", "id": "c1",
                                                    "name": "look", "input": {}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1",
                                               "content": [_b64_block(_png(3))]}]}]
    used = client.messages.create(model=model, max_tokens=2, messages=tool_turn).usage
    span = chat["usage"]["prompt_tokens"] - 5                  # the five text tokens t5..t9
    assert used.input_tokens + used.cache_read_input_tokens == 1 + span     # t1, the image


@pytest.mark.parametrize("block,needle", [
    ({"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
     "does not fetch"),
    ({"type": "image", "source": {"type": "file", "file_id": "file_1"}}, "Files API"),
    (_b64_block(b"these bytes are no image"), "cannot be decoded"),
    (_b64_block(_png(1), "image/bmp"), "media_type"),
], ids=["url", "file", "not-an-image", "bmp"])
def test_anthropic_bad_images_are_400s(server, block, needle):
    srv = server[0]
    model = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    client = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=model, max_tokens=2,
                               messages=[{"role": "user", "content": [block]}])
    assert e.value.status_code == 400 and needle in e.value.body["error"]["message"]


@pytest.mark.parametrize("field", ["multi_modal_data", "media_urls"])
def test_completions_refuse_images(server, field):
    """vLLM's /v1/completions takes no media: an image in its fields is a 400 pointing to
    chat, not a completion of the text with the image dropped."""
    r = httpx.post(server[0].url + "/v1/completions", timeout=60, json={
        "prompt": "t5 t6", "max_tokens": 2, field: {"image": [_url(_png(1))]}})
    assert r.status_code == 400, r.text
    assert "takes no images" in r.json()["error"]["message"]
    assert "/v1/chat/completions" in r.json()["error"]["message"]


def test_pd_router_serves_an_image_chat_as_one_server(stack):
    """router -> prefill (the module's server) -> decode (a consumer over NIXL), the
    router in-process: a chat request holding an image gives the one-server greedy tokens,
    decoded with the KV pulled from the prefill instance (every position but the last)."""
    import asyncio
    from wideserve.serving.openai.pd_router import RouterConfig, build_app
    srv, _, decode, _ = stack
    want, one = _server_tokens(srv)
    app = build_app(RouterConfig([srv.url], [decode.url], max_request_bytes=1 << 24,
                                 body_read_timeout_s=30.0, kv_secret=KV_SECRET.encode()))

    async def go() -> httpx.Response:
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://router", timeout=120) as c:
                return await c.post("/v1/chat/completions", json={
                    "messages": [{"role": "user",
                                  "content": _content(_image(_url(_png(1))))}],
                    "max_tokens": 3, "temperature": 0.0, "ignore_eos": True,
                    "logprobs": True, "return_tokens_as_token_ids": True})
        finally:
            await app.state.router.client.aclose()
    r = asyncio.run(go())
    assert r.status_code == 200, r.text
    got = [int(t["token"].split(":")[1])
           for t in r.json()["choices"][0]["logprobs"]["content"]]
    assert got == want
    assert r.json()["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    kv = httpx.get(decode.url + "/debug/stats", timeout=30).json()["stats"]["kv_transfer"]
    assert kv["loads_done"] == 1 and kv["loads_failed"] == 0
    assert kv["tokens_loaded"] == one["usage"]["prompt_tokens"] - 1
