"""Fill-in-the-middle prompts, built as llama-server builds /infill's: the other files' chunks
first (each after the file-separator token and its name, where the vocabulary has one), then
the prefix token, the code before the cursor, the suffix token, the code after it, and the
middle token, after which the model writes what goes between.

Only a vocabulary with prefix, suffix and middle tokens can do it (llama.cpp finds them by the
GGUF's declaration or their text, Model.fim_tokens); for any other, a 400 naming the field."""
from __future__ import annotations

from dataclasses import dataclass

from cllm.errors import APIError

# llama-server's names for what it does not know: the project and the current file.
_PROJECT = "myproject\n"
_CURRENT_FILE = "filename\n"
# What separates the other files' chunks for a vocabulary without a file separator.
_CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"


@dataclass(frozen=True, slots=True)
class FileChunk:
    """Another file's text the completion may draw on (/infill's input_extra)."""
    filename: str
    text: str


@dataclass(frozen=True, slots=True)
class Infill:
    prefix: str  # the code before the cursor
    suffix: str  # the code after it
    prompt: str = ""  # text that continues the prefix (llama-server's `prompt`)
    extra: tuple[FileChunk, ...] = ()


def require_fim(model, param: str) -> None:
    """A 400 naming `param` unless the model's vocabulary can fill in the middle."""
    fim = model.fim_tokens
    if min(fim.prefix, fim.suffix, fim.middle) < 0:
        raise APIError(400, f"{param}: the model's vocabulary has no fill-in-the-middle tokens "
                       "(prefix, suffix and middle)", param=param, code="fim_not_supported")


def infill_prompt(model, infill: Infill) -> list[int]:
    """The prompt's tokens (tokenizes: run it on the tokenizer's threads). The client's texts
    are tokenized as text, special-token names in them included."""
    fim = model.fim_tokens
    text = lambda s: list(model.tokenize(s, False, False))  # noqa: E731
    extra = []
    if fim.repo >= 0:
        extra += [fim.repo, *text(_PROJECT)]
    for chunk in infill.extra:
        extra += ([fim.file_sep, *text(chunk.filename + "\n")] if fim.file_sep >= 0
                  else text(_CHUNK_SEPARATOR))
        extra += text(chunk.text)
    if fim.file_sep >= 0:
        extra += [fim.file_sep, *text(_CURRENT_FILE)]
    bos = [model.bos_token] if model.adds_bos and model.bos_token >= 0 else []
    return [*extra, *bos, fim.prefix, *text(infill.prefix), *text(infill.prompt),
            fim.suffix, *text(infill.suffix), fim.middle]


def read_infill(body: dict) -> Infill:
    """/infill's input_prefix, input_suffix, input_extra ([{"filename", "text"}]) and prompt."""
    texts = {}
    for name in ("input_prefix", "input_suffix", "prompt"):
        value = body.get(name, "")
        if not isinstance(value, str):
            raise APIError(400, f"{name} must be a string", param=name)
        texts[name] = value
    extra = body.get("input_extra") or []
    if not isinstance(extra, list):
        raise APIError(400, "input_extra must be an array", param="input_extra")
    chunks = []
    for i, chunk in enumerate(extra):
        if not (isinstance(chunk, dict) and isinstance(chunk.get("text", ""), str)
                and isinstance(chunk.get("filename", ""), str)):
            raise APIError(400, f'input_extra[{i}] must be {{"filename": string, "text": '
                           "string}", param="input_extra")
        chunks.append(FileChunk(chunk.get("filename") or "tmp", chunk.get("text", "")))
    return Infill(texts["input_prefix"], texts["input_suffix"], texts["prompt"], tuple(chunks))
