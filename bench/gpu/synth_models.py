"""Writes a GGUF with the exact tensor shapes and hyperparameters of a real architecture, random
weights and a synthetic tokenizer of the real vocabulary's size: a model of the size people run,
for measuring speed without downloading one (the text it writes is meaningless).

    python bench/gpu/synth_models.py llama-3.2-1b OUT.gguf [--threads N] [--seed S]

Weights are normal with std 0.02 in F16 (norms 1.0, in F32 as converters write them), generated
tensor by tensor over threads, so memory stays near the largest tensor (1 GB for Llama-3.1-8B's
embeddings); quantize the file with the pinned llama-quantize (bench/gpu/model_sizes.sh). The
tokenizer is byte-level BPE, like the real ones: the 256 byte symbols, then pairs of them, then
pair + byte, merged in that order, so llama.cpp tokenizes and detokenizes any text; then the
special tokens at their real ids (BOS, EOS, chat markers). Needs numpy and gguf (the pinned
llama.cpp's gguf-py is 0.19.0)."""
from __future__ import annotations

import argparse
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import gguf
import numpy as np

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
    "<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@dataclass(frozen=True)
class Arch:
    """What the Hugging Face config.json of the model says, in GGUF's terms."""
    name: str
    arch: str  # llama.cpp's architecture
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_vocab: int
    n_regular: int  # tokens before the special ones
    n_ctx_train: int
    rope_theta: float
    rms_eps: float
    tied: bool  # the output projection is the token embedding
    qkv_bias: bool
    pre: str  # llama.cpp's pre-tokenizer
    specials: dict[int, tuple[str, int]]  # id: (text, token type)
    bos: int
    eos: int
    add_bos: bool
    template: str
    llama3_rope: dict = field(default_factory=dict)  # factor, low/high_freq_factor, original ctx

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


CONTROL, USER_DEFINED, UNUSED = (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED,
                                 gguf.TokenType.UNUSED)


def llama3_specials() -> dict[int, tuple[str, int]]:
    named = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
             "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
             "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
             "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    named += [f"<|reserved_special_token_{i}|>" for i in range(3, 3 + 256 - len(named))]
    return {128000 + i: (text, CONTROL) for i, text in enumerate(named)}


def qwen2_specials() -> dict[int, tuple[str, int]]:
    control = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
               "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
               "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
               "<|image_pad|>", "<|video_pad|>"]
    user = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
            "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
    tokens = [(t, CONTROL) for t in control] + [(t, USER_DEFINED) for t in user]
    out = {151643 + i: tok for i, tok in enumerate(tokens)}
    # The embedding has rows past the tokenizer's last token: converters name them [PADn].
    out.update({i: (f"[PAD{i}]", UNUSED) for i in range(151643 + len(tokens), 151936)})
    return out


ARCHS = {a.name: a for a in (
    Arch("llama-3.2-1b", "llama", n_embd=2048, n_ff=8192, n_layer=16, n_head=32, n_head_kv=8,
         n_vocab=128256, n_regular=128000, n_ctx_train=131072, rope_theta=500000.0,
         rms_eps=1e-5, tied=True, qkv_bias=False, pre="llama-bpe", specials=llama3_specials(),
         bos=128000, eos=128009, add_bos=True, template=LLAMA3_TEMPLATE,
         llama3_rope={"factor": 32.0, "low": 1.0, "high": 4.0, "original": 8192}),
    Arch("qwen2.5-3b", "qwen2", n_embd=2048, n_ff=11008, n_layer=36, n_head=16, n_head_kv=2,
         n_vocab=151936, n_regular=151643, n_ctx_train=32768, rope_theta=1000000.0,
         rms_eps=1e-6, tied=True, qkv_bias=True, pre="qwen2", specials=qwen2_specials(),
         bos=151643, eos=151645, add_bos=False, template=CHATML_TEMPLATE),
    Arch("llama-3.1-8b", "llama", n_embd=4096, n_ff=14336, n_layer=32, n_head=32, n_head_kv=8,
         n_vocab=128256, n_regular=128000, n_ctx_train=131072, rope_theta=500000.0,
         rms_eps=1e-5, tied=False, qkv_bias=False, pre="llama-bpe", specials=llama3_specials(),
         bos=128000, eos=128009, add_bos=True, template=LLAMA3_TEMPLATE,
         llama3_rope={"factor": 8.0, "low": 1.0, "high": 4.0, "original": 8192}),
)}


# ---- the tokenizer ----

def byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: each byte as a printable character (bytes_to_unicode)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def vocabulary(a: Arch) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): the byte symbols, their pairs, pair + byte, up to the
    regular tokens' count; then the special tokens at their ids. Every merge makes a token of
    the vocabulary, as llama.cpp's BPE requires."""
    symbols = byte_symbols()
    tokens, merges = list(symbols), []
    for left in symbols:
        for right in symbols:
            tokens.append(left + right)
            merges.append(f"{left} {right}")
    pairs = tokens[256:]
    for pair in pairs:
        for right in symbols:
            if len(tokens) >= a.n_regular:
                break
            tokens.append(pair + right)
            merges.append(f"{pair} {right}")
    types = [gguf.TokenType.NORMAL] * len(tokens)
    for i in range(a.n_regular, a.n_vocab):
        text, kind = a.specials[i]
        tokens.append(text)
        types.append(kind)
    return tokens, types, merges


# ---- the tensors ----

def tensor_shapes(a: Arch) -> dict[str, tuple[int, ...]]:
    """name: numpy shape (rows are GGUF's second dimension), in the order converters write."""
    q, kv = a.n_head * a.head_dim, a.n_head_kv * a.head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (a.n_vocab, a.n_embd)}
    if a.llama3_rope:
        shapes["rope_freqs.weight"] = (a.head_dim // 2,)
    for i in range(a.n_layer):
        b = f"blk.{i}."
        shapes |= {b + "attn_norm.weight": (a.n_embd,), b + "attn_q.weight": (q, a.n_embd),
                   b + "attn_k.weight": (kv, a.n_embd), b + "attn_v.weight": (kv, a.n_embd)}
        if a.qkv_bias:
            shapes |= {b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)}
        shapes |= {b + "attn_output.weight": (a.n_embd, q), b + "ffn_norm.weight": (a.n_embd,),
                   b + "ffn_gate.weight": (a.n_ff, a.n_embd),
                   b + "ffn_up.weight": (a.n_ff, a.n_embd),
                   b + "ffn_down.weight": (a.n_embd, a.n_ff)}
    shapes["output_norm.weight"] = (a.n_embd,)
    if not a.tied:
        shapes["output.weight"] = (a.n_vocab, a.n_embd)
    return shapes


def is_f32(shape: tuple[int, ...]) -> bool:
    """Converters keep 1-D tensors (norms, biases, rope factors) in F32."""
    return len(shape) == 1


def llama3_rope_factors(a: Arch) -> np.ndarray:
    """The per-frequency factors of Llama 3's rope scaling, as llama.cpp's converter computes
    them into rope_freqs.weight."""
    r = a.llama3_rope
    freqs = 1.0 / (a.rope_theta ** (np.arange(0, a.head_dim, 2, dtype=np.float32) / a.head_dim))
    low_wavelen, high_wavelen = r["original"] / r["low"], r["original"] / r["high"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(r["factor"])
        else:
            smooth = (r["original"] / wavelen - r["low"]) / (r["high"] - r["low"])
            factors.append(1 / ((1 - smooth) / r["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


CHUNK = 1 << 24  # values one thread draws at a time


def random_f16(shape: tuple[int, ...], seed: tuple[int, ...],
               pool: ThreadPoolExecutor) -> np.ndarray:
    """Normal values with std 0.02 in F16, drawn in chunks over the pool's threads (numpy's
    generators release the GIL); each chunk's stream is fixed by `seed` and its index."""
    out = np.empty(math.prod(shape), dtype=np.float16)

    def fill(k: int) -> None:
        part = out[k * CHUNK:(k + 1) * CHUNK]
        rng = np.random.default_rng([*seed, k])
        values = rng.standard_normal(part.size, dtype=np.float32)
        values *= 0.02
        part[:] = values

    list(pool.map(fill, range(math.ceil(out.size / CHUNK))))
    return out.reshape(shape)


def tensor_data(name: str, shape: tuple[int, ...], a: Arch, seed: tuple[int, ...],
                pool: ThreadPoolExecutor) -> np.ndarray:
    if name == "rope_freqs.weight":
        return llama3_rope_factors(a)
    if name.endswith(".bias"):
        return (np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * 0.02)
    if is_f32(shape):
        return np.ones(shape, dtype=np.float32)
    return random_f16(shape, seed, pool)


# ---- the file ----

def add_metadata(w: gguf.GGUFWriter, a: Arch) -> None:
    w.add_name(f"synthetic {a.name} (random weights)")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_context_length(a.n_ctx_train)
    w.add_embedding_length(a.n_embd)
    w.add_block_count(a.n_layer)
    w.add_feed_forward_length(a.n_ff)
    w.add_head_count(a.n_head)
    w.add_head_count_kv(a.n_head_kv)
    w.add_key_length(a.head_dim)
    w.add_value_length(a.head_dim)
    w.add_rope_dimension_count(a.head_dim)
    w.add_rope_freq_base(a.rope_theta)
    w.add_layer_norm_rms_eps(a.rms_eps)
    w.add_vocab_size(a.n_vocab)
    tokens, types, merges = vocabulary(a)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(a.pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(a.bos)
    w.add_eos_token_id(a.eos)
    w.add_add_bos_token(a.add_bos)
    w.add_chat_template(a.template)


def write(a: Arch, path: str, threads: int, seed: int) -> None:
    shapes = tensor_shapes(a)
    w = gguf.GGUFWriter(path, a.arch)
    add_metadata(w, a)
    for name, shape in shapes.items():
        dtype = np.float32 if is_f32(shape) else np.float16
        w.add_tensor_info(name, shape, np.dtype(dtype), math.prod(shape) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    with ThreadPoolExecutor(threads) as pool:
        for index, (name, shape) in enumerate(shapes.items()):
            w.write_tensor_data(tensor_data(name, shape, a, (seed, index), pool))
    w.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arch", choices=ARCHS)
    parser.add_argument("out")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    a = ARCHS[args.arch]
    params = sum(math.prod(s) for s in tensor_shapes(a).values())
    started = time.monotonic()
    write(a, args.out, args.threads, args.seed)
    print(f"{args.out}: {a.name}, {params / 1e9:.2f} B parameters, "
          f"{os.path.getsize(args.out) / 1e9:.2f} GB, {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
