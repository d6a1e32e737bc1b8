"""What the server says about its model: the names clients address it by and its size, for
/v1/models, /v1/models/{id} and /props.

Two names: the served name (`id`: --served-model-name, else the alias or file name given to
--model) and the repository the weights come from (`root`, as vLLM reports it), which tools such
as benchmarks use to find the model's tokenizer."""
from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from cllm.models import ALIASES

# GGUF metadata keys that name the model's own repository, most specific first. The base model's
# comes last: a fine-tune's tokenizer is usually its base's, but its name is not.
_REPO_KEYS = ("general.source.huggingface.repository", "general.repo_url",
              "general.source.repo_url")
_BASE_REPO_KEY = "general.base_model.0.repo_url"


def repo_id(metadata: dict[str, str], model_arg: str | None) -> str | None:
    """"org/name" from the GGUF's metadata, else from the alias the model was loaded by."""
    for key in _REPO_KEYS:
        found = _org_name(metadata.get(key, ""))
        if found:
            return found
    spec = ALIASES.get(model_arg or "")
    if spec is not None and spec.repo_id:
        return spec.repo_id
    return _org_name(metadata.get(_BASE_REPO_KEY, ""))


def model_names(served: str, root: str, path: str) -> frozenset[str]:
    """Every name a request may address the model by: the served name, the repository id and
    the aliases (cllm/models.py) of its file, however it was loaded."""
    filename = Path(path).name
    aliases = {alias for alias, spec in ALIASES.items() if spec.filename == filename}
    return frozenset({served, root, *aliases})


def _org_name(value: str) -> str | None:
    """"org/name" from a repository id or a repository URL (its path's first two parts)."""
    path = urlparse(value).path if "://" in value else value
    parts = [p for p in path.split("/") if p]
    return f"{parts[0]}/{parts[1]}" if len(parts) >= 2 else None


def model_card(name: str, root: str, engine) -> dict:
    """One entry of /v1/models, in OpenAI's shape with vLLM's `root` and `max_model_len`, and
    llama-server's `meta`; a model not loaded (engine None) has neither, unknown until it is."""
    card = {"id": name, "object": "model", "created": 0, "owned_by": "cllm", "root": root,
            "parent": None}
    if engine is None:
        return card
    model = engine.model
    return {**card, "max_model_len": engine.max_seq_len,
            "meta": {"n_ctx": engine.max_seq_len, "n_ctx_train": model.n_ctx_train,
                     "n_vocab": model.n_vocab, "n_params": model.n_params,
                     "size": model.size_bytes, "description": model.description}}


# llama.cpp's file types (enum llama_ftype, the GGUF's general.file_type), by the names the
# quantization tools give them.
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
               10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M",
               16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S",
               22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M",
               28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0",
               37: "TQ2_0", 38: "MXFP4_MOE"}


def quantization(metadata: dict[str, str]) -> str:
    """The weights' type from the GGUF's general.file_type ("Q4_K_M"); "unknown" without it."""
    file_type = metadata.get("general.file_type", "")
    return _FILE_TYPES.get(int(file_type), "unknown") if file_type.isdigit() else "unknown"


def parameter_size(n_params: int) -> str:
    """A parameter count as Ollama writes it: "134.52M", "3.21B"."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n_params >= scale:
            return f"{n_params / scale:.2f}".rstrip("0").rstrip(".") + unit
    return str(n_params)
