"""Chat templates (cllm/http/chat_template.py): the sandbox, the helpers templates use, errors
as 400s, and the renderer's limits on time, memory and output; no model needed."""
import asyncio
import multiprocessing
import time
import tracemalloc

import pytest

from cllm.errors import APIError
from cllm.http.chat_template import ChatTemplate, TemplateRenderer


def rejects(call) -> APIError:
    """call() raises a 400 APIError."""
    with pytest.raises(APIError) as info:
        call()
    assert info.value.status == 400
    return info.value


# SmolLM2-Instruct's template (ChatML with a default system prompt), as its GGUF carries it.
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}")

# Gemma's template: no system role, strict alternation, checked with raise_exception.
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")

USER_HI = [{"role": "user", "content": "Hi"}]


def test_smollm2_template():
    template = ChatTemplate(SMOLLM2, bos_token="<|im_start|>", eos_token="<|im_end|>")
    assert template.render(USER_HI) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    conversation = [{"role": "system", "content": "Be brief."}, *USER_HI,
                    {"role": "assistant", "content": "Hello!"}]
    assert template.render(conversation, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n")


def test_chatml_fallback_without_a_template():
    template = ChatTemplate(None, bos_token="", eos_token="")
    assert template.render([{"role": "system", "content": "S"}, *USER_HI]) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_gemma_template_and_raise_exception():
    template = ChatTemplate(GEMMA, bos_token="<bos>", eos_token="<eos>")
    assert template.render([{"role": "user", "content": " Hi \n"},
                            {"role": "assistant", "content": "Hello"}, *USER_HI]) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n")
    err = rejects(lambda: template.render([{"role": "system", "content": "S"}, *USER_HI]))
    assert err.message == "chat template error: System role not supported"
    err = rejects(lambda: template.render(USER_HI * 2))
    assert "Conversation roles must alternate" in err.message


def test_template_helpers():
    source = ("{{ messages | tojson }}|{{ strftime_now('%Y') | length }}"
              "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
              "{{ m.content }}{% endfor %}")
    out = ChatTemplate(source, bos_token="", eos_token="").render(
        [{"role": "user", "content": "<é>"}, {"role": "user", "content": "no"}])
    assert out == ('[{"role": "user", "content": "<é>"}, {"role": "user", "content": "no"}]'
                   "|4<é>")


@pytest.mark.parametrize("source", [
    "{{ ''.__class__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ raise_exception.__globals__ }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ messages.append({'role': 'x'}) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ '{0.__class__.__mro__}'.format(messages) }}",
])
def test_sandbox_blocks_python_internals(source):
    template = ChatTemplate(source, bos_token="", eos_token="")
    err = rejects(lambda: template.render(USER_HI))
    assert err.message.startswith("chat template error:")


@pytest.mark.parametrize("source", [
    "{{ messages[5]['content'] }}",       # undefined
    "{{ messages[0]['content'] + 1 }}",  # TypeError
    "{{ 1 / 0 }}",
    "{{ messages | tojson(separators=5) }}",  # TypeError inside a filter
])
def test_runtime_template_errors_are_400(source):
    rejects(lambda: ChatTemplate(source, bos_token="", eos_token="").render(USER_HI))


def test_template_that_does_not_compile_raises_value_error():
    with pytest.raises(ValueError, match="invalid chat template"):
        ChatTemplate("{% for m in messages %}{{ m }}", bos_token="", eos_token="")


def test_rendered_messages_are_not_mutated():
    messages = [dict(m) for m in USER_HI]
    ChatTemplate(SMOLLM2, bos_token="", eos_token="").render(messages)
    assert messages == USER_HI


def test_rendered_prompt_is_bounded():
    template = ChatTemplate("{% for i in range(10) %}{{ 'x' * 100 }}{% endfor %}",
                            bos_token="", eos_token="", max_chars=1000)
    assert template.render(USER_HI) == "x" * 1000
    template.max_chars = 999
    err = rejects(lambda: template.render(USER_HI))
    assert err.message == "chat template error: the rendered prompt is over 999 characters"


# Spins when asked to; says the message otherwise.
SPIN = ("{% if messages[0].content == 'spin' %}{% for i in range(100000) %}"
        "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}{{ messages[0].content }}")


def render_all(source: str, contents: list[str], timeout: float = 30) -> list[str]:
    """Each content rendered as a one-message chat by one renderer, in turn: the prompt, or
    the 400's message."""
    async def main():
        renderer = TemplateRenderer(ChatTemplate(source, bos_token="", eos_token=""),
                                    timeout=timeout)
        out = []
        try:
            for content in contents:
                try:
                    out.append(await renderer.render([{"role": "user", "content": content}]))
                except APIError as err:
                    assert err.status == 400
                    out.append(err.message)
        finally:
            renderer.close()
        return out
    return asyncio.run(main())


def test_renderer_renders():
    assert render_all(SPIN, ["Hi", "again"]) == ["Hi", "again"]


def template_workers() -> set[int]:
    return {p.pid for p in multiprocessing.active_children() if p.name == "cllm-template"}


def started_renderer(workers: int = 2) -> TemplateRenderer:
    """A renderer once its workers' processes exist (they may still be starting)."""
    renderer = TemplateRenderer(ChatTemplate(SPIN, bos_token="", eos_token=""), timeout=30,
                                workers=workers)
    deadline = time.monotonic() + 30
    while len(template_workers()) < workers and time.monotonic() < deadline:
        time.sleep(0.01)
    return renderer


def test_every_worker_starts_with_the_renderer_and_renders_without_another_start():
    renderer = started_renderer()
    try:
        started = template_workers()
        assert len(started) == 2  # before any request asked for a render

        async def two_at_once():
            return await asyncio.gather(*(renderer.render([{"role": "user", "content": "Hi"}])
                                          for _ in range(2)))
        assert asyncio.run(two_at_once()) == ["Hi", "Hi"]
        assert template_workers() == started
    finally:
        renderer.close()


def test_a_renderer_closed_while_its_workers_start_closes_cleanly():
    """A server that stops at once: the threads that started the workers still wait for them,
    and each wakes to close its worker while close() does. A race: without the lock in
    _Worker.kill, about one in ten of these closes raised EBADF and left a worker running."""
    for attempt in range(12):
        renderer = started_renderer()
        time.sleep(0.04 * (attempt % 4))  # at several points of the workers' start
        renderer.close()
    renderer.close()  # and again
    assert template_workers() == set()


def test_render_past_its_deadline_is_a_400_and_the_next_render_works():
    assert render_all(SPIN, ["spin", "Hi"], timeout=1) == [
        "chat template error: rendering took over 1 s", "Hi"]


def test_compiling_a_template_evaluates_none_of_its_expressions():
    # Compiling happens in the server's own process, without the workers' memory limit.
    source = "{{ 'x' * 10**8 }}{{ 'y' | center(100000000) }}{% if 'z' * 10**8 %}{% endif %}"
    tracemalloc.start()
    try:
        ChatTemplate(source, bos_token="", eos_token="")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20  # a folded expression would hold 100 MB


def test_render_past_the_memory_limit_is_a_400_and_the_next_render_works():
    source = "{% if messages[0].content == 'big' %}{{ 'x' * 10**11 }}{% endif %}ok"
    refused, ok = render_all(source, ["big", "Hi"])
    assert refused.startswith("chat template error: rendering needs over") and ok == "ok"


def test_a_template_that_reads_tools_says_so_and_gets_them():
    source = ("{% if tools %}{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% endif %}"
              "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    template = ChatTemplate(source, bos_token="", eos_token="")
    assert template.takes_tools
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert template.render(USER_HI, tools) == "[f]Hi"
    assert template.render(USER_HI) == "Hi"
    assert not ChatTemplate(SMOLLM2, bos_token="", eos_token="").takes_tools
