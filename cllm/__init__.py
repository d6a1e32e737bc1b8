"""cllm: an LLM inference server for GGUF models."""
