"""One three-turn tool-using agent loop per client SDK and mode (see agent_loop.py).

Every loop asks the same thing three times over one conversation: the model must call
`weather(city)` on each turn (the call is forced by naming the tool in tool_choice: the
bundled tiny model writes random text, and a forced call is constrained decoding, so the call
is certain), the tool's result goes back into the conversation, and the next turn sees it.
A loop passes when:
  - the tool ran three times, each with a valid argument (city in CITIES);
  - each turn's prompt is longer than the last (the previous turn's call and result reached
    the server), wherever the client reports usage;
  - the final answer (plain loops: a fourth turn with tool_choice none) is text.
Each function raises on failure (AssertionError or the client's own exception).
"""
from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

CITIES = ["Verona", "Mantua", "Padua"]
City = Literal["Verona", "Mantua", "Padua"]      # the same, for SDKs that read type hints
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
          "required": ["city"], "additionalProperties": False}
TOOL_NAME = "weather"
QUESTION = "Check the weather three times, once per turn, in Verona, Mantua or Padua."
TURNS = 3
MAX_TOKENS = 48


@dataclass
class Server:
    base_url: str                   # http://host:port (no /v1)
    model: str
    api_key: str


@dataclass
class Trace:
    """What a loop saw: the tool's calls and each turn's prompt size (when reported)."""
    calls: list[str] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)

    def weather(self, city: str) -> str:
        assert city in CITIES, f"tool called with city={city!r}"
        self.calls.append(city)
        return f"result {len(self.calls)}: sunny in {city}, 21 C"

    def check(self, final_text: str | None = None) -> str:
        assert len(self.calls) == TURNS, f"tool ran {len(self.calls)} times, not {TURNS}"
        sizes = self.prompt_tokens
        assert all(a < b for a, b in zip(sizes, sizes[1:])), f"prompts did not grow: {sizes}"
        if final_text is not None:
            assert isinstance(final_text, str), f"final answer is {type(final_text)}"
        grown = f"prompt tokens {sizes}" if sizes else "no usage reported"
        return f"calls {self.calls}; {grown}"


def _openai_tool() -> dict[str, Any]:
    return {"type": "function", "function": {"name": TOOL_NAME, "description":
                                             "The weather in a city", "parameters": SCHEMA}}


FORCED = {"type": "function", "function": {"name": TOOL_NAME}}


# ----------------------------------------------------------------------------- openai

def openai_chat(srv: Server, stream: bool) -> str:
    import openai
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=srv.api_key, max_retries=0)
    trace, messages = Trace(), [{"role": "user", "content": QUESTION}]
    for turn in range(TURNS + 1):
        kwargs: dict[str, Any] = dict(model=srv.model, messages=messages, tools=[_openai_tool()],
                                      tool_choice=FORCED if turn < TURNS else "none",
                                      max_tokens=MAX_TOKENS, temperature=0.0)
        if stream:
            message, usage = _openai_chat_stream(client, kwargs)
        else:
            r = client.chat.completions.create(**kwargs)
            message, usage = r.choices[0].message, r.usage
        trace.prompt_tokens.append(usage.prompt_tokens)
        if turn == TURNS:
            return trace.check(message.content)
        # The SDK's own message object goes back, as agents echo it.
        messages.append(message if not stream else message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            result = trace.weather(**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    raise AssertionError("unreachable")


def _openai_chat_stream(client: Any, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    from openai.types.chat import ChatCompletionMessage
    content, calls, usage = "", {}, None
    for chunk in client.chat.completions.create(**kwargs, stream=True,
                                                stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "type": "function",
                                                   "function": {"name": "", "arguments": ""}})
                slot["id"] = tc.id or slot["id"]
                if tc.function is not None:
                    slot["function"]["name"] += tc.function.name or ""
                    slot["function"]["arguments"] += tc.function.arguments or ""
    message = ChatCompletionMessage(role="assistant", content=content or None,
                                    tool_calls=[calls[i] for i in sorted(calls)] or None)
    return message, usage


def openai_responses(srv: Server, stream: bool) -> str:
    import openai
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=srv.api_key, max_retries=0)
    tool = {"type": "function", "name": TOOL_NAME, "description": "The weather in a city",
            "parameters": SCHEMA, "strict": True}
    trace, items = Trace(), [{"role": "user", "content": QUESTION}]
    for turn in range(TURNS + 1):
        kwargs = dict(model=srv.model, input=items, tools=[tool], max_output_tokens=MAX_TOKENS,
                      tool_choice={"type": "function", "name": TOOL_NAME} if turn < TURNS
                      else "none", temperature=0.0)
        if stream:
            response = None
            for event in client.responses.create(**kwargs, stream=True):
                # OpenAI ends a stream cut by max_output_tokens with response.incomplete
                if event.type in ("response.completed", "response.incomplete"):
                    response = event.response
            assert response is not None, \
                "the stream ended without response.completed / response.incomplete"
        else:
            response = client.responses.create(**kwargs)
        trace.prompt_tokens.append(response.usage.input_tokens)
        if turn == TURNS:
            return trace.check(response.output_text)
        calls = [o for o in response.output if o.type == "function_call"]
        assert calls, f"turn {turn}: no function_call in {response.output}"
        for call in calls:
            items.append(call.model_dump(exclude_none=True))
            items.append({"type": "function_call_output", "call_id": call.call_id,
                          "output": trace.weather(**json.loads(call.arguments))})
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------- openai-agents

def _agents_run(srv: Server, stream: bool, responses: bool) -> str:
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel,
                        Runner, ToolsToFinalOutputResult, function_tool, set_tracing_disabled)
    from openai import AsyncOpenAI
    set_tracing_disabled(True)                     # no trace export to api.openai.com
    trace = Trace()

    @function_tool(name_override=TOOL_NAME)
    def weather(city: City) -> str:
        """The weather in a city (Verona, Mantua or Padua)."""
        return trace.weather(city)

    def after_tools(_ctx: Any, _results: Any) -> ToolsToFinalOutputResult:
        # The forced choice stays on every turn (reset_tool_choice=False); the third result
        # ends the run with it as the final output.
        done = len(trace.calls) >= TURNS
        return ToolsToFinalOutputResult(is_final_output=done,
                                        final_output=_results[-1].output if done else None)

    client = AsyncOpenAI(base_url=srv.base_url + "/v1", api_key=srv.api_key, max_retries=0)
    model_cls = OpenAIResponsesModel if responses else OpenAIChatCompletionsModel
    agent = Agent(name="forecaster", instructions="Use the weather tool.", tools=[weather],
                  model=model_cls(model=srv.model, openai_client=client),
                  model_settings=ModelSettings(tool_choice=TOOL_NAME, temperature=0.0,
                                               max_tokens=MAX_TOKENS, include_usage=True),
                  tool_use_behavior=after_tools, reset_tool_choice=False)

    async def run() -> Any:
        if not stream:
            return await Runner.run(agent, QUESTION, max_turns=TURNS + 1)
        result = Runner.run_streamed(agent, QUESTION, max_turns=TURNS + 1)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    trace.prompt_tokens = [r.usage.input_tokens for r in result.raw_responses
                           if r.usage is not None and r.usage.input_tokens]
    return trace.check(str(result.final_output))


def agents_responses(srv: Server, stream: bool) -> str:
    return _agents_run(srv, stream, responses=True)


def agents_chat(srv: Server, stream: bool) -> str:
    return _agents_run(srv, stream, responses=False)


# ----------------------------------------------------------------------------- anthropic

def anthropic_messages(srv: Server, stream: bool) -> str:
    import anthropic
    client = anthropic.Anthropic(base_url=srv.base_url, api_key=srv.api_key, max_retries=0)
    tool = {"name": TOOL_NAME, "description": "The weather in a city", "input_schema": SCHEMA}
    trace, messages = Trace(), [{"role": "user", "content": QUESTION}]
    for turn in range(TURNS + 1):
        kwargs = dict(model=srv.model, max_tokens=MAX_TOKENS, messages=messages, tools=[tool],
                      tool_choice={"type": "tool", "name": TOOL_NAME} if turn < TURNS
                      else {"type": "none"}, extra_body={"temperature": 0.0})
        if stream:
            with client.messages.stream(**kwargs) as s:
                message = s.get_final_message()
        else:
            message = client.messages.create(**kwargs)
        trace.prompt_tokens.append(message.usage.input_tokens
                                   + (message.usage.cache_read_input_tokens or 0))
        if turn == TURNS:
            return trace.check("".join(b.text for b in message.content if b.type == "text"))
        assert message.stop_reason == "tool_use", message.stop_reason
        messages.append({"role": "assistant", "content": message.content})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": trace.weather(**b.input)}
            for b in message.content if b.type == "tool_use"]})
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------- LangChain

def langchain_openai(srv: Server, stream: bool) -> str:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool as lc_tool
    from langchain_openai import ChatOpenAI
    trace = Trace()

    @lc_tool(TOOL_NAME, args_schema=SCHEMA)
    def weather(city: str) -> str:
        """The weather in a city."""
        return trace.weather(city)

    llm = ChatOpenAI(model=srv.model, base_url=srv.base_url + "/v1", api_key=srv.api_key,
                     temperature=0.0, max_tokens=MAX_TOKENS, max_retries=0,
                     stream_usage=True)
    messages: list[Any] = [HumanMessage(QUESTION)]
    for turn in range(TURNS + 1):
        bound = llm.bind_tools([weather], tool_choice=TOOL_NAME if turn < TURNS else "none")
        if stream:
            ai = None
            for chunk in bound.stream(messages):
                ai = chunk if ai is None else ai + chunk
        else:
            ai = bound.invoke(messages)
        assert ai is not None
        if ai.usage_metadata:
            trace.prompt_tokens.append(ai.usage_metadata["input_tokens"])
        if turn == TURNS:
            return trace.check(ai.content if isinstance(ai.content, str) else str(ai.content))
        assert ai.tool_calls, f"turn {turn}: no tool_calls in {ai!r}"
        messages.append(ai)
        for call in ai.tool_calls:
            messages.append(ToolMessage(weather.invoke(call["args"]), tool_call_id=call["id"]))
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------- LiteLLM

def litellm_completion(srv: Server, stream: bool) -> str:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # no fetch at import
    import litellm
    litellm.suppress_debug_info = True
    trace, messages = Trace(), [{"role": "user", "content": QUESTION}]
    for turn in range(TURNS + 1):
        kwargs = dict(model="openai/" + srv.model, api_base=srv.base_url + "/v1",
                      api_key=srv.api_key, messages=messages, tools=[_openai_tool()],
                      tool_choice=FORCED if turn < TURNS else "none", max_tokens=MAX_TOKENS,
                      temperature=0.0, num_retries=0)
        if stream:
            chunks = list(litellm.completion(**kwargs, stream=True,
                                             stream_options={"include_usage": True}))
            r = litellm.stream_chunk_builder(chunks, messages=messages)
        else:
            r = litellm.completion(**kwargs)
        message = r.choices[0].message
        trace.prompt_tokens.append(r.usage.prompt_tokens)
        if turn == TURNS:
            return trace.check(message.content)
        assert message.tool_calls, f"turn {turn}: no tool_calls in {message!r}"
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": trace.weather(**json.loads(call.function.arguments))})
    raise AssertionError("unreachable")


# (client, mode) -> loop; "mode" names the API the client drives.
LOOPS: dict[tuple[str, str], Callable[[Server, bool], str]] = {
    ("openai", "chat.completions"): openai_chat,
    ("openai", "responses"): openai_responses,
    ("openai-agents", "responses (default)"): agents_responses,
    ("openai-agents", "chat.completions model"): agents_chat,
    ("anthropic", "messages"): anthropic_messages,
    ("langchain-openai", "chat.completions"): langchain_openai,
    ("litellm", "chat.completions"): litellm_completion,
}
