"""Bad input never hurts the server: each case gets its 4xx in OpenAI's error shape, and the
server keeps serving. Also the API key and the body-size limit. One server for the module."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from oai_server_utils import MAX_LEN, VOCAB, RemoteServer, served, write_tiny_model

KEY = "sekret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 64 * 1024
NAME = "tiny"

OK_COMPLETION = {"model": NAME, "prompt": "Hello", "max_tokens": 2}
OK_CHAT = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def _c(**kw):
    return {**OK_COMPLETION, **kw}


def _chat(**kw):
    return {**OK_CHAT, **kw}


def _without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


# (id, path, body (dict -> JSON, bytes -> raw), status, text the message must contain)
CASES = [
    ("missing-prompt", "/v1/completions", _without(OK_COMPLETION, "prompt"), 400, "prompt"),
    ("max-tokens-string", "/v1/completions", _c(max_tokens="5"), 400, "max_tokens"),
    ("max-tokens-negative", "/v1/completions", _c(max_tokens=-1), 400, "max_tokens"),
    ("max-tokens-zero", "/v1/completions", _c(max_tokens=0), 400, "only allowed with echo"),
    ("max-tokens-huge", "/v1/completions", _c(max_tokens=10**30), 400, "max_tokens"),
    ("max-tokens-over-context", "/v1/completions", _c(max_tokens=MAX_LEN * 4), 400,
     "maximum context length"),
    ("prompt-over-context", "/v1/completions", _c(prompt="word " * (MAX_LEN * 2)), 400,
     "maximum context length"),
    ("temperature-negative", "/v1/completions", _c(temperature=-0.5), 400, "temperature"),
    ("temperature-too-high", "/v1/completions", _c(temperature=3.5), 400, "temperature"),
    ("temperature-string", "/v1/completions", _c(temperature="hot"), 400, "temperature"),
    ("temperature-bool", "/v1/completions", _c(temperature=True), 400, "temperature"),
    ("top-p-zero", "/v1/completions", _c(top_p=0), 400, "top_p"),
    ("top-k-negative", "/v1/completions", _c(top_k=-5), 400, "top_k"),
    ("min-p-above-one", "/v1/completions", _c(min_p=1.5), 400, "min_p"),
    ("n-zero", "/v1/completions", _c(n=0), 400, "n"),
    ("n-huge", "/v1/completions", _c(n=100000), 400, "n"),
    ("logprobs-too-many", "/v1/completions", _c(logprobs=50), 400, "logprobs"),
    ("seed-too-big", "/v1/completions", _c(seed=2**70), 400, "seed"),
    # passed to the engine as is: an integer the engine link cannot carry was a 500 (fuzzer)
    ("kv-params-int-past-64-bit", "/v1/completions",
     _c(kv_transfer_params={"x": [1, {"y": 155014788936044052480}]}), 400,
     "kv_transfer_params"),
    ("kv-params-int-past-64-bit-chat", "/v1/chat/completions",
     _chat(kv_transfer_params={"x": -2**64}), 400, "kv_transfer_params"),
    ("penalty-out-of-range", "/v1/completions", _c(presence_penalty=5), 400,
     "presence_penalty"),
    ("empty-stop", "/v1/completions", _c(stop=[""]), 400, "stop"),
    ("stop-wrong-type", "/v1/completions", _c(stop=5), 400, "stop"),
    ("stop-token-negative", "/v1/completions", _c(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("stop-token-outside-vocab", "/v1/completions", _c(stop_token_ids=[VOCAB + 7]), 400,
     "stop_token_ids"),
    ("min-tokens-over-max", "/v1/completions", _c(min_tokens=10, max_tokens=2), 400,
     "min_tokens"),
    ("prompt-empty-list", "/v1/completions", _c(prompt=[]), 400, "prompt"),
    ("prompt-empty-ids", "/v1/completions", _c(prompt=[[]]), 400, "prompt"),
    ("prompt-negative-id", "/v1/completions", _c(prompt=[-5, 3]), 400, "prompt"),
    ("prompt-id-outside-vocab", "/v1/completions", _c(prompt=[3, VOCAB]), 400, "vocabulary"),
    ("prompt-mixed-types", "/v1/completions", _c(prompt=["a", 3]), 400, "prompt"),
    ("logit-bias-outside-vocab", "/v1/completions", _c(logit_bias={str(VOCAB + 1): 10}), 400,
     "logit_bias"),
    ("logit-bias-not-an-id", "/v1/completions", _c(logit_bias={"abc": 10}), 400,
     "logit_bias"),
    ("unknown-model", "/v1/completions", _c(model="gpt-17"), 404, "does not exist"),
    ("priority-without-policy", "/v1/completions", _c(priority=3), 400, "priority"),
    ("best-of-unsupported", "/v1/completions", _c(best_of=3), 400, "best_of"),
    ("suffix-unsupported", "/v1/completions", _c(suffix="x"), 400, "suffix"),
    ("stream-options-without-stream", "/v1/completions",
     _c(stream_options={"include_usage": True}), 400, "stream_options"),
    ("invalid-utf8", "/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe\xfd"}', 400,
     "JSON"),
    ("truncated-json", "/v1/completions", b'{"model": "tiny", "prompt": "hi", "max_tok', 400,
     "JSON"),
    ("not-an-object", "/v1/completions", b"[1, 2, 3]", 400, "object"),
    ("null-body", "/v1/completions", b"null", 400, "object"),
    ("empty-body", "/v1/completions", b"", 400, "empty"),
    ("nan", "/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": NaN}', 400,
     ""),
    ("chat-empty-messages", "/v1/chat/completions", _chat(messages=[]), 400, "messages"),
    ("chat-missing-messages", "/v1/chat/completions", _without(OK_CHAT, "messages"), 400,
     "messages"),
    ("chat-no-role", "/v1/chat/completions", _chat(messages=[{"content": "x"}]), 400, "role"),
    ("chat-bad-role", "/v1/chat/completions",
     _chat(messages=[{"role": "wizard", "content": "x"}]), 400, "role"),
    ("chat-content-number", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": 5}]), 400, "content"),
    ("chat-no-content", "/v1/chat/completions", _chat(messages=[{"role": "user"}]), 400,
     "content"),
    ("chat-image-part", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": [{"type": "image_url",
                                                    "image_url": {"url": "x"}}]}]), 400,
     "takes no image inputs"),      # a text model (a V4.1 one: test_server_images.py)
    ("chat-top-logprobs-without-logprobs", "/v1/chat/completions", _chat(top_logprobs=2), 400,
     "top_logprobs"),
    ("chat-json-schema", "/v1/chat/completions",
     _chat(response_format={"type": "json_schema"}), 400, "response_format"),
    ("chat-max-completion-tokens-zero", "/v1/chat/completions",
     _chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("chat-over-context", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": "word " * MAX_LEN * 2}], max_tokens=None), 400,
     "maximum context length"),
    # Union fields: the message names the branch that got furthest and what is allowed.
    ("prompt-id-too-big", "/v1/completions", _c(prompt=[1, 2**31]), 400, "2147483647"),
    ("prompt-triple-nested", "/v1/completions", _c(prompt=[[[1, 2]]]), 400, "token-id lists"),
    ("prompt-fractional-id", "/v1/completions", _c(prompt=[1, 2.5]), 400, "integer, got 2.5"),
    ("prompt-empty-inner-list", "/v1/completions", _c(prompt=[[1, 2], []]), 400,
     "at least 1 item"),
    ("stop-too-many", "/v1/completions", _c(stop=["a"] * 100), 400, "at most 16"),
    ("chat-text-and-image-parts", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": [
         {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}]),
     400, "takes no image inputs"),
    ("lone-surrogate", "/v1/completions", b'{"model": "tiny", "prompt": "\\ud800"}', 400,
     "surrogate"),
    ("nested-json-completions", "/v1/completions",
     b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400, "nested"),
    ("nested-json-tokenize", "/tokenize", b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}",
     400, "nested"),
    ("nested-json-chat", "/v1/chat/completions",
     b'{"messages": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400, "nested"),
    ("tokenize-wrong-type", "/tokenize", {"prompt": 5}, 400, "prompt"),
    ("detokenize-negative", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("detokenize-outside-vocab", "/detokenize", {"tokens": [VOCAB * 10]}, 400, "vocabulary"),
]


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    model = write_tiny_model(tmp_path_factory.mktemp("tiny"))
    srv = RemoteServer([str(model), "--load-format", "dummy", "--device", "cpu",
                        "--block-size", "16", "--kv-cache-memory", "4MiB",
                        "--served-model-name", NAME, "--api-key", KEY,
                        "--max-request-bytes", str(LIMIT)])
    yield from served(request, srv)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as client:
        yield client


def _check_error_shape(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_4xx(http, case):
    _, path, body, status, needle = case
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = http.post(path, content=content, headers={"Content-Type": "application/json"})
    err = _check_error_shape(resp, status)
    assert needle.lower() in (err["message"] + " " + str(err["param"])).lower(), err


def test_bad_streaming_request_is_rejected_before_streaming(http):
    resp = http.post("/v1/chat/completions", json=_chat(stream=True, temperature=-1))
    _check_error_shape(resp, 400)


def test_oversize_bodies_get_413(http):
    big = json.dumps(_c(prompt="x" * (2 * LIMIT))).encode()
    _check_error_shape(http.post("/v1/completions", content=big), 413)
    json_type = {"Content-Type": "application/json"}

    def chunks():                               # no Content-Length: chunked upload
        for i in range(0, len(big), 4096):
            yield big[i:i + 4096]

    _check_error_shape(http.post("/v1/completions", content=chunks(), headers=json_type), 413)


def test_api_key_required(server):
    url = server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        err = _check_error_shape(httpx.post(url + "/v1/completions", json=OK_COMPLETION,
                                            headers=headers), 401)
        assert err["code"] == "invalid_api_key"
    _check_error_shape(httpx.get(url + "/v1/models"), 401)
    _check_error_shape(httpx.post(url + "/tokenize", json={"prompt": "x"}), 401)
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert good.models.list().data[0].id == NAME


def test_unknown_route_uses_error_shape(http):
    _check_error_shape(http.get("/v1/does-not-exist"), 404)
    resp = http.get("/v1/completions")
    _check_error_shape(resp, 405)
    assert resp.headers["allow"] == "POST"


GOOD_BODIES = {"/v1/completions": OK_COMPLETION, "/v1/chat/completions": OK_CHAT,
               "/tokenize": {"prompt": "Hi"}, "/detokenize": {"tokens": [5]}}


@pytest.mark.parametrize("path", sorted(GOOD_BODIES))
def test_json_content_type_required(http, path):
    body = json.dumps(GOOD_BODIES[path]).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": content_type} if content_type else {}
        req = http.build_request("POST", path, content=body, headers=headers)
        assert req.headers.get("content-type") == content_type
        err = _check_error_shape(http.send(req), 415)
        assert "application/json" in err["message"] and err["code"] == "unsupported_media_type"
    resp = http.post(path, content=body,
                     headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert resp.status_code == 200, resp.text


def test_integral_floats_are_integers(http):
    r = http.post("/v1/completions", json=_c(n=2.0, max_tokens=3.0, seed=7.0, ignore_eos=True,
                                                 prompt=[5.0, 6, 7.0]))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6
    assert http.post("/detokenize", json={"tokens": [5.0]}).status_code == 200
    err = _check_error_shape(http.post("/v1/completions", json=_c(n=1.5)), 400)
    assert err["param"] == "n" and "1.5" in err["message"]


def test_echoed_input_is_clipped_and_param_filled(http):
    err = _check_error_shape(http.post("/v1/completions", json=_c(model="m" * 60_000)), 404)
    assert err["code"] == "model_not_found" and len(err["message"]) < 300
    assert "60000 long" in err["message"]
    err = _check_error_shape(http.post("/v1/completions",
                                       json=_c(stream_options={"include_usage": True})), 400)
    assert err["param"] == "stream_options"
    err = _check_error_shape(http.post("/v1/completions", json=_c(prompt=[1, 2**31])), 400)
    assert err["param"] == "prompt.1"


def test_still_serving_after_the_bad_inputs(server, http):
    # Runs after the table: the engine is alive and a normal request of each kind works.
    assert httpx.get(server.url + "/health").status_code == 200
    r = http.post("/v1/completions", json=_c(max_tokens=3, ignore_eos=True))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    r = http.post("/v1/chat/completions", json=_chat(max_tokens=3, ignore_eos=True))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    metrics = httpx.get(server.url + "/metrics").text
    rejected = [line for line in metrics.splitlines()
                if line.startswith("wideserve:requests_total") and 'outcome="rejected"' in line]
    assert rejected and float(rejected[0].rsplit(" ", 1)[1]) >= len(CASES) - 3


def test_add_special_tokens(http):
    """vLLM's add_special_tokens: this tokenizer prepends BOS unless told not to (completions
    default true; chat default false, the template writing its own)."""
    def prompt_tokens(path: str, **kw) -> int:
        r = http.post(path, json={**(_c() if "chat" not in path else _chat()), **kw})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    assert prompt_tokens("/v1/completions", add_special_tokens=False) == \
        prompt_tokens("/v1/completions") - 1
    assert prompt_tokens("/v1/chat/completions", add_special_tokens=True) == \
        prompt_tokens("/v1/chat/completions") + 1
