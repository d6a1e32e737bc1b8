"""One module per API protocol, each holding its routes: OpenAI (openai.py, openai_responses.py,
embeddings.py), Anthropic (anthropic.py), llama-server (llama_server.py) and cllm's original
/generate (generate.py). They import the HTTP plumbing (cllm.http) and are imported only by the
apps (cllm.app.server, cllm.scaleout.ray_app)."""
