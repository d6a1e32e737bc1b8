"""The HTTP layer's shared plumbing, used by every protocol's routes: the app's state and body
reading (common.py), request schemas and field checks (schemas.py), generation and streaming
(generation.py, formats.py, responses.py), tool calls, chat templates, metrics, the model card."""
