"""flopwise: pretrain 100M-2B language models with performance discipline."""

__version__ = "0.1.0"


def load(path, device="cpu", dtype=None):
    """``(model, tokenizer)`` from a run directory, a checkpoint directory or a Hugging Face
    model directory: see :func:`flopwise.model.io.load`. Imported lazily, so that
    ``import flopwise`` stays light (tokenizer worker processes import the package)."""
    from flopwise.model.io import load as _load  # lazy: torch; `import flopwise` must stay light

    return _load(path, device=device, dtype=dtype)
