"""cllm: an LLM inference server for GGUF models.

Run from a checkout after `pip install .` (README's first command), `python -m cllm.serve` finds
the checkout's `cllm/` first, which has no built native extension: the package then also
searches the installed copy's directory, so that the checkout's modules run with that copy's
`_core` (as the tests and the processes they start, Ray's replicas among them, do too)."""
import os
from importlib import machinery


def _installed_extension_dirs(own: str) -> list[str]:
    """[the installed copy's directory] when `own` has no `_core` extension of its own, else []."""
    if any(os.path.exists(os.path.join(own, "_core" + suffix))
           for suffix in machinery.EXTENSION_SUFFIXES):
        return []
    from importlib import metadata  # here: an installed or built copy never needs it
    try:
        files = metadata.files("cllm") or []
    except metadata.PackageNotFoundError:
        return []
    return [str(f.locate().parent) for f in files
            if f.parent.name == "cllm" and f.name.startswith("_core.")
            and f.suffix in (".so", ".pyd")][:1]


__path__ += [d for d in _installed_extension_dirs(__path__[0]) if d not in __path__]
