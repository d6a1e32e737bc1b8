"""`python -m cllm.bench`: a load benchmark for OpenAI-compatible servers (cllm, llama-server).

Modules: cli (options), workloads (what each level sends), prompts (their text), loadgen
(requests and their timing), stats (the figures), report (JSON, table, plot), servers (starting
cllm), peer (building and starting llama-server), direct (cllm's Engine in-process)."""
