"""Which constrained-decoding library: llguidance or xgrammar, measured on SmolLM2's vocabulary.

For each library that imports: schema compile time and coverage over the test schemas
(tests/data/schemas.json), and the time to fill the token bitmasks of 1, 8 and 64 rows at once
(the library's batched call), per row and token, while each row walks its grammar by taking a
random allowed token. The vocabulary comes from the GGUF through cllm's Model (token bytes,
control tokens marked), never from Hugging Face.

    python bench/probes/structured_libs.py [--model PATH] [--steps 48]

xgrammar imports torch and transformers at import time although the calls measured here take
numpy arrays (DLPack): where they are not installed, put stand-in modules on PYTHONPATH to
measure it anyway (the dependency weight is reported from the package metadata either way)."""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import random
import statistics
import time
from pathlib import Path

import numpy as np

SCHEMAS = Path(__file__).resolve().parents[2] / "tests" / "data" / "schemas.json"
ROWS = (1, 8, 64)


class LLGuidance:
    """Masks filled a row at a time on the calling thread, a call into llguidance each."""
    name = "llguidance"

    def __init__(self, model) -> None:
        import llguidance

        from cllm.engine.structured import tokenizer_of
        self.lib = llguidance
        self.tokenizer = tokenizer_of(model)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict):
        grammar = self.lib.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = self.lib.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matchers(self, compiled, n):
        return [compiled.deep_copy() for _ in range(n)]

    def fill(self, matchers, bitmask) -> None:
        for i, m in enumerate(matchers):
            m.unsafe_compute_mask_ptr(bitmask[i].ctypes.data, bitmask.shape[1] * 4)

    def accept(self, matchers, tokens) -> None:
        for m, t in zip(matchers, tokens):
            if t is None or not m.consume_token(t) or m.is_stopped():
                m.reset()  # a finished (or failed) walk starts over


class LLGuidanceExecutor(LLGuidance):
    """Masks filled by llguidance's thread pool (LLExecutor), all rows in one call, as
    structured.MaskFiller does (here on llguidance's default threads, where cllm takes one on
    a CPU and half the cores, at most 8, on a GPU host)."""

    def fill(self, matchers, bitmask) -> None:
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                              bitmask.ctypes.data, bitmask.shape[1] * 4,
                                              len(matchers))


class XGrammar:
    name = "xgrammar"

    def __init__(self, model) -> None:
        import xgrammar
        self.lib = xgrammar
        vocab = [b"" if model.is_control(t) else model.token_to_piece(t, True)
                 for t in range(model.n_vocab)]
        info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=model.n_vocab,
                                      stop_token_ids=list(model.eog_tokens))
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matchers(self, compiled, n):
        return [self.lib.GrammarMatcher(compiled) for _ in range(n)]

    def fill(self, matchers, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matchers, tokens) -> None:
        for m, t in zip(matchers, tokens):
            if t is None or not m.accept_token(t) or m.is_terminated():
                m.reset()  # a finished (or failed) walk starts over


def allowed_tokens(row: np.ndarray, n_vocab: int) -> np.ndarray:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:n_vocab]
    return np.flatnonzero(bits)


def measure(lib, schemas: list[dict], n_vocab: int, steps: int) -> dict:
    compile_ms, failures = [], []
    compiled = []
    for item in schemas:
        start = time.perf_counter()
        try:
            compiled.append(lib.compile(item["schema"]))
        except Exception as exc:  # any library error is a coverage miss, reported
            failures.append(f"{item['name']}: {str(exc).splitlines()[0][:80]}")
            continue
        compile_ms.append((time.perf_counter() - start) * 1000)
    rng = random.Random(0)
    mask_us = {}
    for n in ROWS:
        matchers = []
        for i in range(n):
            matchers += lib.matchers(compiled[i % len(compiled)], 1)
        bitmask = np.zeros((n, (n_vocab + 31) // 32), dtype=np.int32)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            lib.fill(matchers, bitmask)
            times.append(time.perf_counter() - start)
            picks = []
            for r in range(n):
                allowed = allowed_tokens(bitmask[r], n_vocab)
                picks.append(int(rng.choice(allowed)) if len(allowed) else None)
            lib.accept(matchers, picks)
        mask_us[n] = statistics.median(times) / n * 1e6
    return {"compile_ms_median": statistics.median(compile_ms),
            "compile_ms_max": max(compile_ms), "schemas_compiled": len(compiled),
            "schemas": len(schemas), "failures": failures, "mask_us_per_row_token": mask_us}


def package_facts(name: str) -> dict:
    try:
        meta = importlib.metadata.metadata(name)
    except importlib.metadata.PackageNotFoundError:
        return {"installed": False}
    requires = [r.split(";")[0].strip() for r in (meta.get_all("Requires-Dist") or [])
                if "extra ==" not in r]
    return {"version": meta["Version"],
            "license": meta.get("License-Expression") or meta.get("License"),
            "requires": requires}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF path (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--steps", type=int, default=48, help="tokens walked per row count")
    args = parser.parse_args()
    from cllm.llama import _core
    from cllm.models import resolve_model
    model = _core.Model(args.model or str(resolve_model("smollm2-135m-instruct")))
    schemas = json.loads(SCHEMAS.read_text())
    report = {"vocab": model.n_vocab}
    for cls in (LLGuidance, LLGuidanceExecutor, XGrammar):
        facts = package_facts(cls.name)
        try:
            start = time.perf_counter()
            lib = cls(model)
            facts["tokenizer_s"] = time.perf_counter() - start
            facts.update(measure(lib, schemas, model.n_vocab, args.steps))
        except ImportError as exc:
            facts["not_measured"] = f"import failed: {exc}"
        report[cls.__name__] = facts
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
