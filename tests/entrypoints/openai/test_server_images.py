"""Chat image inputs through the real server (serving/openai/images.py): a tiny random
DeepSeek-V4.1 with a 2-layer vision tower (dummy weights), `--limit-mm-per-prompt image=1`.
- an image_url data: URL is served: the placeholder expanded to the image's span where the
  part was, the tokens equal the in-process engine's on those ids and that image;
- a remote URL, bad base64, bytes that are no image, and two images over the limit are 400s
  with a message naming the cause; text-only chat is unaffected.
(A model without a vision tower refusing images: test_server_bad_inputs.py.)"""
from __future__ import annotations

import base64
import io
import json

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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = _model(tmp_path_factory.mktemp("v41_images"))
    srv = RemoteServer([str(path), "--load-format", "dummy", "--dtype", "float32",
                        "--kv-cache-dtype", "bf16", "--max-model-len", "256",
                        "--kv-cache-memory", "64MiB", "--limit-mm-per-prompt", "image=1"])
    try:
        yield srv, path
    finally:
        srv.close()


def _chat(srv, content, **kw) -> httpx.Response:
    body = {"model": srv.url and None, "messages": [{"role": "user", "content": content}],
            "max_tokens": 3, "temperature": 0.0, "ignore_eos": True, **kw}
    body.pop("model")
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)


def test_image_chat_equals_the_engine_on_the_expanded_prompt(server):
    from wideserve.config import engine_config_from_kwargs
    from wideserve.engine.engine_core import EngineCore
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
    core = EngineCore(engine_config_from_kwargs(
        model=str(path), load_format="dummy", dtype="float32", kv_cache_dtype="bf16",
        max_model_len=256, kv_cache_memory=64 << 20))
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
