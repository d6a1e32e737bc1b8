"""The llama.cpp binding: `_core`, the compiled extension (Model, Context with its batch step and
decode runs, Embedder, RowSampler), built from `_core.pyx` and the include files beside it, the
llama.h declarations it calls (`_llama.pxd`) and the C samplers it links: `slot_sampler.c`,
sampling inside llama.cpp's decode graph, and `row_sampler.c`, a row of logits sampled on the
host."""
import os
from importlib import machinery

# Run from a checkout after `pip install .` (README's first command), `python -m cllm.serve` finds
# the checkout's `cllm/` first, whose `llama/` has no built extension: this package then also
# searches the installed copy's `cllm/llama/`, so that the checkout's modules run with that copy's
# `_core` (as the tests and the processes they start, Ray's replicas among them, do too).


def _installed_extension_dirs(own: str) -> list[str]:
    """[the installed copy's cllm/llama directory] when `own` has no `_core` extension of its
    own, else []."""
    if any(os.path.exists(os.path.join(own, "_core" + suffix))
           for suffix in machinery.EXTENSION_SUFFIXES):
        return []
    from importlib import metadata  # here: an installed or built copy never needs it
    try:
        files = metadata.files("cllm") or []
    except metadata.PackageNotFoundError:
        return []
    return [str(f.locate().parent) for f in files
            if f.parent.parts == ("cllm", "llama") and f.name.startswith("_core.")
            and f.suffix in (".so", ".pyd")][:1]


__path__ += [d for d in _installed_extension_dirs(__path__[0]) if d not in __path__]
