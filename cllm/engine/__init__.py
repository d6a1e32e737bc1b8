"""The engine: one thread that schedules, decodes and samples step after step (engine.py), the
scheduler and prefix cache that decide each step, the per-request state (sequences, pending
tokens, text streams), grammars and their masks, and the embedder. It knows nothing of HTTP;
the native core it drives is cllm.llama."""
