"""`python -m cllm.bench.tokenizer OUT.json [--model M]`: the model's tokenizer as a Hugging Face
`tokenizer.json`, built from the GGUF's own vocabulary and merges, for third-party benchmark
clients that count tokens with one (llama-benchy's --tokenizer; guidellm's --tokenizer, given the
directory holding it) on a machine that cannot reach the model hub.

GPT-2-style byte-level BPE vocabularies only (`tokenizer.ggml.model` "gpt2"), with the
pre-tokenizers llama.cpp gives the GPT-2 pattern (digits one by one for SmolLM and its kin);
others are refused rather than approximated. Needs `pip install gguf tokenizers`."""
from __future__ import annotations

import argparse
from pathlib import Path

from cllm.models import DEFAULT_ALIAS, resolve_model

# tokenizer.ggml.pre values whose pattern llama.cpp (src/llama-vocab.cpp) writes as GPT-2's,
# True where it first splits digits one by one.
_GPT2_PATTERN = {"default": False, "gpt2": False, "mpt": False, "olmo": False,
                 "jais": False, "smollm": True, "starcoder": True, "refact": True,
                 "command-r": True, "codeshell": True, "exaone": True, "minerva": True}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types that are matched whole, never split


def _reader(path: Path):
    """tokenizer.ggml.<key> of the GGUF at `path`, read when asked (the arrays are large)."""
    from gguf import GGUFReader
    reader = GGUFReader(str(path))

    def value(key: str):
        field = reader.fields.get(f"tokenizer.ggml.{key}")
        return None if field is None else field.contents()

    return value


def build(path: Path):
    """A `tokenizers.Tokenizer` equal to llama.cpp's for the GGUF at `path`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    value = _reader(path)
    kind, pre = value("model"), value("pre")
    digits = _GPT2_PATTERN.get(pre or "default")
    if kind != "gpt2" or digits is None:
        raise SystemExit(f"{path.name}: tokenizer {kind!r} with pre-tokenizer {pre!r} is not "
                         "exported (GPT-2-style BPE only); use the model's own tokenizer.json")
    tokens = value("tokens")
    merges = [tuple(m.split(" ", 1)) for m in value("merges")]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.pre_tokenizer = (pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), byte_level]) if digits else byte_level)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, value("token_type")) if kind in (_CONTROL, _USER_DEFINED)])
    return tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cllm.bench.tokenizer",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the tokenizer.json to write")
    parser.add_argument("--model", default=DEFAULT_ALIAS, help="alias or GGUF path")
    args = parser.parse_args(argv)
    try:
        tokenizer = build(resolve_model(args.model))
    except ImportError:
        raise SystemExit("this needs gguf and tokenizers: pip install gguf tokenizers") from None
    tokenizer.save(str(args.out))
    print(args.out)


if __name__ == "__main__":
    main()
