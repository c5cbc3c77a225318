"""Agent frameworks as clients: the OpenAI Agents SDK, LangChain (`bind_tools`,
`with_structured_output`) and LangGraph (`create_react_agent`) against `moesplit serve` on a tiny
checkpoint per chat format (Kimi-K2, Kimi-K2-Thinking, DeepSeek-V3, V3.1, V3.2), streamed and
unstreamed, with the options they send (store, metadata, reasoning_effort). Offline: the servers
run in this process on 127.0.0.1 and the SDKs' tracing is off.

Unforced turns are scripted (each request generates the next scripted text in the format's own
syntax, `Queued`); forced turns (tool_choice required / named, structured output) come from the
random model held by the server's grammar, so what they check is that the grammar always ends in a
valid call or object.
"""
import asyncio
import json
import os

import jsonschema
import pytest
import torch

from test_chat_api import Scripted

pytest.importorskip("agents")
pytest.importorskip("langchain_openai")
pytest.importorskip("langgraph")

FORMATS = ("kimi-k2", "kimi-k2-thinking", "deepseek-v3", "deepseek-v31", "deepseek-v32")
KIMI_EOS, DS_EOS = "<|im_end|>", "<｜end▁of▁sentence｜>"

# DeepSeek-V3.1's syntax (`../shared/formats.md`): NAME<｜tool▁sep｜>JSON calls, the `thinking` switch
V31_TEMPLATE = (
    "{{ bos_token }}{% if tools %}## Tools{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'system' %}{{ m.content }}"
    "{% elif m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<｜Assistant｜></think>{{ m.content or '' }}"
    "{% if m.tool_calls %}<｜tool▁calls▁begin｜>{% for c in m.tool_calls %}<｜tool▁call▁begin｜>{{ c.function.name }}"
    "<｜tool▁sep｜>{{ c.function.arguments if c.function.arguments is string else c.function.arguments | tojson }}"
    "<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜>{% endif %}<｜end▁of▁sentence｜>"
    "{% elif m.role == 'tool' %}<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% if thinking %}<think>{% else %}</think>{% endif %}{% endif %}")


def call_text(fmt: str, city: str, n: int = 0) -> str:
    """One get_weather call in the format's own syntax, then its end of turn."""
    args = json.dumps({"city": city})
    if fmt.startswith("kimi"):
        return (f"<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:{n}<|tool_call_argument_begin|>"
                f"{args}<|tool_call_end|><|tool_calls_section_end|>{KIMI_EOS}")
    if fmt == "deepseek-v3":
        return (f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{args}\n```"
                f"<｜tool▁call▁end｜><｜tool▁calls▁end｜>{DS_EOS}")
    if fmt == "deepseek-v31":
        return f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{args}<｜tool▁call▁end｜><｜tool▁calls▁end｜>{DS_EOS}"
    return ("\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
            f"<｜DSML｜parameter name=\"city\" string=\"true\">{city}</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
            f"</｜DSML｜function_calls>{DS_EOS}")


def answer_text(fmt: str, text: str) -> str:
    return text + (KIMI_EOS if fmt.startswith("kimi") else DS_EOS)


class Queued(Scripted):
    """Scripted, each new request taking the next script of `queue` (none left: the random model)."""

    def __init__(self, runner):
        super().__init__(runner)
        self.queue: list[list[int]] = []

    def step(self, ids, chunks, all_logits=False):
        if any(c.start == 0 for c in chunks):
            self.script = self.queue.pop(0) if self.queue else []
        return super().step(ids, chunks, all_logits)


class Server:
    """A served tiny checkpoint of format `fmt` and what the tests need of it."""

    def __init__(self, fmt: str, tmp):
        from checkpoint.reader import CheckpointReader
        from cpu_expert_service.server import load_shard
        from gpu_service.api.tokenizer import load_tokenizer
        from gpu_service.entrypoints.serving import ServingStack
        from gpu_service.experts.handoff import LocalExperts
        from gpu_service.local.tiny import make_tiny
        from gpu_service.runtime.runner import ModelRunner

        kind = "deepseek-v3" if fmt == "deepseek-v31" else fmt
        d = make_tiny(str(tmp / fmt), "bf16", seed=0, arch="deepseek_v32" if fmt == "deepseek-v32" else "deepseek_v3",
                      tokenizer=kind, overrides={"max_position_embeddings": 4096})
        template = None
        if fmt == "deepseek-v31":
            template = str(tmp / "v31.jinja")
            with open(template, "w", encoding="utf-8") as f:
                f.write(V31_TEMPLATE)
        _, backend, _ = load_shard(d, None, None, "numpy")
        self.runner = Queued(ModelRunner(CheckpointReader(d), LocalExperts(backend), device=torch.device("cpu"),
                                         dtype=torch.float32, kv_tokens=8192, page_size=16, prefix_cache=False))
        self.tok = load_tokenizer(d, template)
        self.fmt = fmt
        self.stack = ServingStack(self.runner, self.tok, fmt, port=0, grpc_port=0, max_batch=4,
                                  chunk_tokens=4096).start()
        self.url = self.stack.http_url + "/v1"

    def script(self, *texts: str, thinking: bool = False) -> None:
        """The next requests generate `texts`, one each, then the random model again. `thinking`:
        the turns run with reasoning on (a reasoning_effort), so each text starts as the model's
        would, a thought closed by `</think>` (the DeepSeek formats put what precedes it in
        reasoning_content, tool calls included; Kimi-K2-Thinking's jump into its tool section is
        left unclosed on purpose: its parser ends the reasoning there)."""
        if thinking and self.fmt.startswith("deepseek"):
            texts = tuple("I should look it up.</think>" + t for t in texts)
        self.runner.queue = [self.tok.encode(t, add_bos=False) for t in texts]

    def effort(self) -> str | None:
        """A reasoning_effort this format takes (None: it has no reasoning control)."""
        return {"kimi-k2-thinking": "high", "deepseek-v31": "low", "deepseek-v32": "high"}.get(self.fmt)


# Forced turns come from the random model, whose strings are random text that seldom closes: the
# grammar's cap on an unbounded string (8192 characters by default) is lowered so that every forced
# call ends well inside the frameworks' max_tokens, and what is checked is that it ends valid.
FORCED_CAP = 24


@pytest.fixture(scope="module", params=FORMATS)
def server(request, tmp_path_factory):
    from agents import set_tracing_disabled

    from gpu_service.api import tool_grammar

    set_tracing_disabled(True)
    os.environ.setdefault("LANGSMITH_TRACING", "false")
    s = Server(request.param, tmp_path_factory.mktemp(request.param))
    mp = pytest.MonkeyPatch()
    mp.setattr(tool_grammar, "FORCED_STRING_MAX_CHARS", FORCED_CAP)
    yield s
    mp.undo()
    s.stack.stop()


def get_weather_impl(city: str) -> str:
    return f"sunny in {city}"


# ---- OpenAI Agents SDK ---------------------------------------------------------------------------
def _agent(server, calls: list, **settings):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, function_tool
    from openai import AsyncOpenAI

    @function_tool
    def get_weather(city: str) -> str:
        """Weather of a city."""
        calls.append(city)
        return get_weather_impl(city)

    client = AsyncOpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    model = OpenAIChatCompletionsModel(model=server.fmt, openai_client=client)
    return Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather], model=model,
                 model_settings=ModelSettings(max_tokens=400, **settings))


@pytest.mark.parametrize("stream", [False, True])
def test_agents_sdk_tool_loop(server, stream):
    """A scripted call, the SDK runs the tool, the scripted answer ends the run."""
    from agents import Runner

    calls: list = []
    agent = _agent(server, calls, store=False, metadata={"suite": "agents"},
                   **({"reasoning": {"effort": server.effort()}} if server.effort() else {}))
    server.script(call_text(server.fmt, "Paris"), answer_text(server.fmt, "It is sunny."),
                  thinking=server.effort() is not None)
    if stream:
        async def run():
            r = Runner.run_streamed(agent, "Weather in Paris?", max_turns=4)
            async for _ in r.stream_events():
                pass
            return r
        result = asyncio.run(run())
    else:
        result = Runner.run_sync(agent, "Weather in Paris?", max_turns=4)
    assert calls == ["Paris"]
    assert result.final_output == "It is sunny."


@pytest.mark.parametrize("stream", [False, True])
def test_agents_sdk_three_forced_turns(server, stream):
    """tool_choice required on every turn (no reset), one call a turn (parallel_tool_calls false): the
    tool runs 3 times, each call its own id."""
    from agents import Runner
    from agents.agent import ToolsToFinalOutputResult

    calls: list = []

    def stop_after_three(ctx, results):
        return ToolsToFinalOutputResult(len(calls) >= 3, "done" if len(calls) >= 3 else None)

    agent = _agent(server, calls, tool_choice="required", temperature=1.0, parallel_tool_calls=False)
    agent = agent.clone(reset_tool_choice=False, tool_use_behavior=stop_after_three)
    server.script()
    if stream:
        async def run():
            r = Runner.run_streamed(agent, "Weather, three times.", max_turns=4)
            async for _ in r.stream_events():
                pass
            return r
        result = asyncio.run(run())
    else:
        result = Runner.run_sync(agent, "Weather, three times.", max_turns=4)
    assert len(calls) == 3 and result.final_output == "done"
    ids = [i.raw_item.call_id for i in result.new_items if i.type == "tool_call_item"]
    assert len(ids) == 3 and len(set(ids)) == 3, ids
    if server.fmt.startswith("kimi"):
        assert ids == [f"functions.get_weather:{n}" for n in range(3)]


# ---- LangChain / LangGraph -----------------------------------------------------------------------
def _chat(server, **kw):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=server.fmt, base_url=server.url, api_key="none", max_retries=0, timeout=120,
                      max_tokens=600, use_responses_api=False, **kw)


def _lc_tool():
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Weather of a city."""
        return get_weather_impl(city)
    return get_weather


@pytest.mark.parametrize("stream", [False, True])
def test_langchain_bind_tools(server, stream):
    """Scripted auto call; then a forced call on LangChain's open default schema (random model)."""
    tool = _lc_tool()
    llm = _chat(server, streaming=stream)
    server.script(call_text(server.fmt, "Rome"))
    msg = llm.bind_tools([tool]).invoke("Weather in Rome?")
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("get_weather", {"city": "Rome"})]
    server.script()
    msg = llm.bind_tools([tool], tool_choice="get_weather").invoke("Weather?")
    assert not msg.invalid_tool_calls, msg.invalid_tool_calls
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city"} and isinstance(call["args"]["city"], str)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(server, method):
    from pydantic import BaseModel

    class Forecast(BaseModel):
        city: str
        rain: bool

    server.script()
    out = _chat(server, temperature=1.0).with_structured_output(Forecast, method=method).invoke("Forecast?")
    assert isinstance(out, Forecast)
    jsonschema.validate(out.model_dump(), Forecast.model_json_schema())


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")
def test_langgraph_react_agent(server, stream):
    from langgraph.prebuilt import create_react_agent

    kw = {"reasoning_effort": server.effort()} if server.effort() else {}
    agent = create_react_agent(_chat(server, streaming=stream, store=False, **kw), [_lc_tool()])
    server.script(call_text(server.fmt, "Paris"), answer_text(server.fmt, "Sunny, 21 C."), thinking=bool(kw))
    if stream:
        state = None
        for state in agent.stream({"messages": [("user", "Weather in Paris?")]}, stream_mode="values"):
            pass
    else:
        state = agent.invoke({"messages": [("user", "Weather in Paris?")]})
    kinds = [m.type for m in state["messages"]]
    assert kinds == ["human", "ai", "tool", "ai"], kinds
    assert state["messages"][2].content == "sunny in Paris" and state["messages"][3].content == "Sunny, 21 C."
