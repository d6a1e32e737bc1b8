"""The client libraries people point at an OpenAI-compatible server, unmodified, against the real
server: each path they take (forced tool calls whose schemas carry $defs, batch prompts on
/v1/completions, streams, tools through litellm's `openai/` provider) gives the library's own
parsed result. The official SDKs' other paths (legacy functions, forced pydantic tools, the
Anthropic SDK's max_tokens) are in test_openai.py, test_anthropic.py and
tests/engine/test_structured.py. Everything runs offline: the environment below keeps the
libraries from phoning home."""
from __future__ import annotations

import asyncio
import json
import os

# Set before the libraries load: they read these at import time.
os.environ.update({
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # litellm fetches its price list otherwise
    "LITELLM_TELEMETRY": "False",
    "LANGCHAIN_TRACING_V2": "false", "LANGSMITH_TRACING": "false",
    "LOGFIRE_SEND_TO_LOGFIRE": "false", "LOGFIRE_IGNORE_NO_CONFIG": "1",
    "INSTRUCTOR_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
})

import litellm  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
from langchain_openai import ChatOpenAI, OpenAI  # noqa: E402
from pydantic import BaseModel  # noqa: E402
from pydantic_ai import Agent  # noqa: E402
from pydantic_ai.models.openai import OpenAIChatModel  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402
from server_process import ServerProcess  # noqa: E402
from tool_models import Address, Person  # noqa: E402

MODEL = "smollm2-135m-instruct"
KEY = "unused"
GREEDY = {"temperature": 0}
ASK_PERSON = [{"role": "user", "content": "Alice lives at 1 Main Street in Paris."}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
HTTP_TIMEOUT = 120


class Contact(BaseModel):
    """Two fields only: a short reply, so `create_iterable`'s list stays within max_tokens."""
    name: str
    city: str


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--parallel", "2", "--ctx-size", "4096") as srv:
        yield srv


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return server.url + "/v1"


# ---- openai SDK ----

def test_openai_chat_completions_parse_with_a_nested_model(client):
    r = client.chat.completions.parse(model=MODEL, messages=ASK_PERSON, response_format=Person,
                                      max_tokens=120, **GREEDY)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Person) and isinstance(parsed.address, Address)


def test_openai_parse_with_a_strict_pydantic_tool(client):
    r = client.chat.completions.parse(
        model=MODEL, messages=ASK_PERSON, tools=[openai.pydantic_function_tool(Person)],
        tool_choice={"type": "function", "function": {"name": "Person"}}, max_tokens=120,
        **GREEDY)
    (call,) = r.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Person)


# ---- langchain-openai ----

def test_langchain_openai_llm_batch_keeps_one_generation_per_prompt_in_order(base_url):
    llm = OpenAI(base_url=base_url, api_key=KEY, model=MODEL, max_tokens=8, max_retries=0,
                 temperature=0, batch_size=20)
    prompts = ["The capital of France is", "One plus one is", "The sky is"]
    result = llm.generate(prompts)
    assert [len(g) for g in result.generations] == [1, 1, 1]
    texts = llm.batch(prompts)
    # Greedy: each prompt's completion is the one it gets alone, so the order is the prompts'.
    assert texts == [llm.invoke(p) for p in prompts] and all(texts)
    assert texts == [g[0].text for g in result.generations]


def test_langchain_chat_openai_stream(base_url):
    chat = ChatOpenAI(base_url=base_url, api_key=KEY, model=MODEL, max_tokens=16, max_retries=0,
                      temperature=0)
    chunks = list(chat.stream("Write one sentence about the sea."))
    assert len(chunks) > 1 and "".join(c.content for c in chunks).strip()


def test_langchain_with_structured_output_nested(base_url):
    chat = ChatOpenAI(base_url=base_url, api_key=KEY, model=MODEL, max_tokens=120, max_retries=0,
                      temperature=0)
    person = chat.with_structured_output(Person, method="function_calling").invoke(
        ASK_PERSON[0]["content"])
    assert isinstance(person, Person) and isinstance(person.address, Address)


# ---- litellm ----

def _litellm(base_url, **fields):
    return litellm.completion(model=f"openai/{MODEL}", api_base=base_url, api_key=KEY,
                              temperature=0, num_retries=0, **fields)


def test_litellm_completion_with_a_forced_tool(base_url):
    r = _litellm(base_url, messages=[{"role": "user", "content": "Weather in Paris?"}],
                 tools=[{"type": "function", "function": WEATHER}], max_tokens=60,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)


def test_litellm_completion_streamed_with_a_forced_tool(base_url):
    chunks = list(_litellm(
        base_url, messages=[{"role": "user", "content": "Weather in Paris?"}], stream=True,
        tools=[{"type": "function", "function": WEATHER}], max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    r = litellm.stream_chunk_builder(chunks)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)


def test_litellm_completion_streamed_text(base_url):
    chunks = list(_litellm(base_url, messages=[{"role": "user", "content": "Say hi."}],
                           max_tokens=16, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks).strip()


# ---- instructor ----

@pytest.fixture(scope="module")
def patched(client):
    # Not in the test extra: instructor 1.17 pins jiter below 0.15, which the openai SDK's
    # latest release does not take, and pip then spends minutes trying older releases of both;
    # the tests run where it is installed beside them.
    instructor = pytest.importorskip("instructor")
    return instructor.from_openai(client, mode=instructor.Mode.TOOLS)


def test_instructor_create_nested(patched):
    person = patched.chat.completions.create(model=MODEL, messages=ASK_PERSON,
                                             response_model=Person, max_tokens=120, max_retries=0,
                                             **GREEDY)
    assert isinstance(person, Person) and isinstance(person.address, Address)


def test_instructor_create_iterable(patched):
    ask = [{"role": "user", "content": "Extract the contacts: Alice (Paris), Bob (Rome)."}]
    # Greedy, this small model repeats list items until max_tokens; a frequency penalty lets
    # it close the list (the streamed call is given out once whole).
    contacts = list(patched.chat.completions.create_iterable(
        model=MODEL, messages=ask, response_model=Contact, max_tokens=120, max_retries=0,
        frequency_penalty=1.0, **GREEDY))
    assert contacts and all(isinstance(c, Contact) for c in contacts)


# ---- llama-index (OpenAILike) ----

def test_llama_index_structured_predict(base_url):
    # Not in the test extra: its openai integration pins openai below 3, which the other
    # libraries' latest releases need; the test runs where it is installed beside them.
    openai_like = pytest.importorskip("llama_index.llms.openai_like")
    prompts = pytest.importorskip("llama_index.core.prompts")
    llm = openai_like.OpenAILike(
        model=MODEL, api_base=base_url, api_key=KEY, is_chat_model=True,
        is_function_calling_model=True, context_window=2048, max_tokens=120, temperature=0,
        max_retries=0, timeout=HTTP_TIMEOUT)
    person = llm.structured_predict(Person, prompts.PromptTemplate("Extract the person: {text}"),
                                    text=ASK_PERSON[0]["content"])
    assert isinstance(person, Person) and isinstance(person.address, Address)


# ---- pydantic-ai ----

def test_pydantic_ai_output_type(base_url):
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=base_url, api_key=KEY))
    agent = Agent(model, output_type=Person, retries=0,
                  model_settings={"temperature": 0, "max_tokens": 120})
    result = asyncio.run(agent.run(ASK_PERSON[0]["content"]))
    assert isinstance(result.output, Person) and isinstance(result.output.address, Address)
