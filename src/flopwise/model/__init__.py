"""The Llama-family decoder: :class:`Transformer` and its one constructor :func:`build_model`."""

from flopwise.model.transformer import Transformer, build_model, init_weights

__all__ = ["Transformer", "build_model", "init_weights"]
