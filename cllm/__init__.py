"""cllm: an LLM inference server for GGUF models.

CLLM_PACKAGE_PATH names more directories of this package, searched after its own: how the
tests run the working tree's Python code with an installed copy's native extension. A variable
rather than a path set in one process, so that every process it starts (Ray's replicas) finds
the same modules."""
import os

__path__ += [p for p in os.environ.get("CLLM_PACKAGE_PATH", "").split(os.pathsep) if p]
