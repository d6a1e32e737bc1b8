"""The app and its launch: the Starlette app with every route (server.py), who may call it
(access.py), the chat page (webui.py, static files in web/), and uvicorn running it for a
configuration (launch.py). The command line is cllm/serve.py."""
