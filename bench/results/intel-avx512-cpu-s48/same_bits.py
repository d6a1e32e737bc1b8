"""Prints a digest of greedy texts and prefill logprobs (tile path) for fixed prompts."""
import hashlib, sys
sys.path.insert(0, '/work/main/tests')
from test_core import prefill_together, generate_together, ints
from cllm import _core
from cllm.models import resolve_model
model = _core.Model(str(resolve_model("smollm2-135m-instruct")))
ctx = _core.Context(model, n_ctx=16 * 512, n_seq_max=16, n_batch=512, kv_unified=False)
prompts = [f"Story number {i}: the" for i in range(7)] + ["The capital of France is", "1+1=", "def fib(n):", "A long time ago, in a galaxy"]
outs = generate_together(ctx, model, prompts, 40)
h = hashlib.sha256()
for o in outs: h.update(repr(o).encode())
# prefill logprobs of each prompt's first token (multi-token rows go through the tiles)
first, pos = prefill_together(ctx, model, prompts, list(range(len(prompts))))
_, lp = ctx.step(ints(range(len(prompts))), ints(pos), ints([1]*len(prompts)), ints([1]*len(prompts)), first, ints([5]*len(prompts)))
for i in range(len(prompts)): h.update(repr(lp.row(i)).encode())
print(h.hexdigest(), model.detokenize(outs[7])[:60])
# a long prompt: its 512-token pieces go through the 64-row attention tiles
doc = model.tokenize(" ".join(f"word{i % 97} is a fact about the topic number {i}." for i in range(104)))[:1433]
ctx = _core.Context(model, n_ctx=4096, n_seq_max=2, n_batch=512, kv_unified=False)
ctx.set_sampler(0)
h2 = hashlib.sha256()
for start in range(0, len(doc), 512):
    n = min(512, len(doc) - start)
    last = ctx.step(ints([0]), ints([start]), ints([n]), ints([1 if start + n == len(doc) else 0]), ints(doc[start:start + n]), ints([5]))
    if start + n == len(doc):
        tok, lp = last
        h2.update(repr(lp.row(0)).encode())
pos = len(doc); out = []
t = list(tok)
for _ in range(20):
    t, lp = ctx.step(ints([0]), ints([pos]), ints([1]), ints([1]), ints(t), ints([5]))
    h2.update(repr(lp.row(0)).encode()); out.append(t[0]); pos += 1
print("long", h2.hexdigest(), repr(model.detokenize(out))[:80])
