"""Chat templates: a GGUF's Jinja source compiled in a sandbox and rendered into a prompt.

The template is untrusted code: it comes with the model file. Jinja's sandbox bounds what it may
touch, not how long it runs or how much memory it takes, so the server renders it with a
TemplateRenderer: in worker processes with a memory limit, killed past a deadline."""
from __future__ import annotations

import json
import multiprocessing
import resource
import signal
import threading
from datetime import datetime

import jinja2
import jinja2.nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cllm.errors import APIError
from cllm.http.pool import WorkPool

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's sandbox turns an unsafe attribute (``''.__class__``) into an undefined value that
    prints as nothing; fail at once instead, so probing a template is an error, not silence."""

    def unsafe_undefined(self, obj, attribute):
        raise SecurityError(f"access to attribute {attribute!r} of a "
                            f"{type(obj).__name__!r} object is unsafe")


@jinja2.pass_eval_context
def _at_render_time(eval_ctx, value):
    """Output as is. Jinja evaluates constant expressions while it compiles, in the server's own
    process where no memory or time limit holds (`{{ 'x' * 10**11 }}` filled a 128 GB machine's
    memory there); `optimized=False` stops its optimizer and a finalize that needs the render's
    context stops the rest, so every expression runs when rendering, in the limited worker."""
    return value


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)  # Hugging Face's convention for template-side checks


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; prompts need the plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


# Everything a template can fail with at render time; none of it is a server bug.
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, LookupError, ArithmeticError,
                  AttributeError, RecursionError)


# The longest prompt a template may render. Far beyond any context, yet a bound: a template
# may not fill memory with output.
MAX_PROMPT_CHARS = 16 * 1024 * 1024
WORKER_MEMORY_BYTES = 1 << 30  # address space of a render worker
WORKER_START_TIMEOUT = 60.0  # seconds for a worker process to start: not the template's time


class ChatTemplate:
    """A GGUF chat template (Jinja source) compiled once in a sandboxed environment.
    With no source, ChatML. A template that does not compile raises ValueError."""

    def __init__(self, source: str | None, *, bos_token: str, eos_token: str,
                 max_chars: int = MAX_PROMPT_CHARS) -> None:
        env = _Sandbox(trim_blocks=True, lstrip_blocks=True, optimized=False,
                       finalize=_at_render_time, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        self.source = source
        text = CHATML_TEMPLATE if source is None else source
        try:
            self._template = env.from_string(text)
            # Whether the template renders tools itself (else tools.py describes them). Not
            # jinja2.meta.find_undeclared_variables: it folds constants as the compiler would.
            self.takes_tools = any(node.name == "tools" and node.ctx == "load"
                                   for node in env.parse(text).find_all(jinja2.nodes.Name))
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"invalid chat template (line {e.lineno}): {e.message}") from None
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.max_chars = max_chars

    def render(self, messages: list[dict], tools: list[dict] | None = None, *,
               add_generation_prompt: bool = True) -> str:
        """The prompt, rendered in this thread with no time or memory limit (TemplateRenderer
        adds them); a template error or a prompt over max_chars is a 400 APIError. `tools`
        (OpenAI's tool objects) reach the template as its `tools` variable, if given."""
        extra = {"tools": tools} if tools is not None else {}
        try:
            return self._join(self._template.generate(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token, **extra))
        except _RENDER_ERRORS as e:
            raise APIError(400, f"chat template error: {e}") from None

    def _join(self, pieces) -> str:
        out, size = [], 0
        for piece in pieces:
            size += len(piece)
            if size > self.max_chars:
                raise APIError(400, "chat template error: the rendered prompt is over "
                               f"{self.max_chars} characters")
            out.append(piece)
        return "".join(out)


class TemplateRenderer:
    """Renders a ChatTemplate in worker processes, one per thread of its own pool. A render
    that runs past `timeout` seconds is killed with its worker, one that needs more than
    WORKER_MEMORY_BYTES fails; either is a 400, and the next render gets a fresh worker. A
    render whose caller left before its turn never starts; closing answers every waiting one
    with PoolClosed (cllm/http/pool.py)."""

    def __init__(self, template: ChatTemplate, *, timeout: float, workers: int = 2) -> None:
        self.template = template  # compiled here too: what the workers render
        self.timeout = timeout
        self._pool = WorkPool(workers, "cllm-template")
        self._local = threading.local()
        self._workers: set[_Worker] = set()
        self._lock = threading.Lock()
        # Start every worker now, so no early request waits for a process to start (~0.5 s on
        # a 2-core CPU). Each start blocks its thread until ready, so each lands on its own.
        for _ in range(workers):
            self._pool.submit(self._ready_worker)

    async def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        return await self._pool.run(self._render, messages, tools)

    @property
    def busy(self) -> bool:
        """Whether a render still runs on one of the pool's threads."""
        return self._pool.busy

    def close(self, wait: bool = False) -> None:
        """Stop the renderer; with `wait`, return once its threads have ended (an unloaded
        model's memory comes back only then)."""
        self._pool.close(wait)
        with self._lock:
            for worker in self._workers:
                worker.kill()

    def _ready_worker(self) -> _Worker:
        """This thread's worker, started and ready."""
        worker = getattr(self._local, "worker", None)
        if worker is None or not worker.alive:
            worker = self._local.worker = self._start_worker()
        worker.wait_ready()
        return worker

    def _render(self, messages: list[dict], tools: list[dict] | None) -> str:
        worker = self._ready_worker()
        try:
            return worker.render(messages, tools, self.timeout)
        except _WorkerLost as exc:
            with self._lock:
                self._workers.discard(worker)
            raise APIError(400, f"chat template error: {exc}") from None

    def _start_worker(self) -> _Worker:
        t = self.template
        worker = _Worker((t.source, t.bos_token, t.eos_token, t.max_chars))
        with self._lock:
            self._workers.add(worker)
        return worker


class _WorkerLost(Exception):
    """A render worker was killed (past its deadline) or died (out of memory)."""


class _Worker:
    """One render process and the pipe to it; used by one thread at a time."""

    def __init__(self, args: tuple) -> None:
        # spawn, not fork: the server's process holds llama.cpp's threads and the GPU.
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, *args), daemon=True,
                                        name="cllm-template")
        self._process.start()
        child.close()
        self._ready = False
        self._kill_lock = threading.Lock()

    @property
    def alive(self) -> bool:
        return self._process.is_alive()

    def wait_ready(self) -> None:
        if not self._ready:
            try:
                self._ready = self._receive(WORKER_START_TIMEOUT) == "ready"
            except _WorkerLost as exc:  # not the template's doing: a server fault
                raise RuntimeError(f"a chat template worker did not start: {exc}") from None

    def render(self, messages: list[dict], tools: list[dict] | None, timeout: float) -> str:
        self.wait_ready()
        self._conn.send((messages, tools))
        ok, value = self._receive(timeout)
        if not ok:
            raise APIError(400, value)
        return value

    def _receive(self, timeout: float):
        if not self._conn.poll(timeout):
            self.kill()
            raise _WorkerLost(f"rendering took over {timeout:g} s")
        try:
            return self._conn.recv()
        except EOFError:
            self.kill()
            raise _WorkerLost("the renderer died (over its memory limit?)") from None

    def kill(self) -> None:
        """Stop the process and close the pipe. Idempotent, from any thread: a server that
        stops closes the workers while their threads may still wait for them to start."""
        with self._kill_lock:
            if self._conn.closed:
                return
            self._process.kill()
            self._process.join()
            self._conn.close()


def _serve(conn, source: str | None, bos_token: str, eos_token: str, max_chars: int) -> None:
    """A render worker's main loop: (messages, tools) in, (True, prompt) or (False, error
    message) out."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the server, which stops us
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    template = ChatTemplate(source, bos_token=bos_token, eos_token=eos_token, max_chars=max_chars)
    conn.send("ready")
    while True:
        try:
            messages, tools = conn.recv()
        except EOFError:  # the server is gone
            return
        try:
            conn.send((True, template.render(messages, tools)))
        except APIError as e:
            conn.send((False, e.message))
        except MemoryError:
            conn.send((False, "chat template error: rendering needs over "
                              f"{WORKER_MEMORY_BYTES >> 20} MiB of memory"))
