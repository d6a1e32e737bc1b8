import time, sys
from array import array
from cllm import _core
from cllm.models import resolve_model
model = _core.Model(str(resolve_model("smollm2-135m-instruct")))
ctx = _core.Context(model, n_ctx=16384, n_seq_max=8, n_batch=512, n_ubatch=512, n_threads=2, kv_unified=False)
doc = model.tokenize(" ".join(f"word{i % 97} is a fact about the topic number {i}." for i in range(104)))[:1434]
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 2
for r in range(reps):
    t = time.perf_counter()
    for start in range(0, len(doc), 512):
        n = min(512, len(doc) - start)
        ctx.step(array("i", [0]), array("i", [start]), array("i", [n]), array("i", [0]), array("i", doc[start:start + n]))
    print(f"prefill {len(doc)} tokens: {time.perf_counter() - t:.2f} s", flush=True)
    ctx.remove_sequence(0)
