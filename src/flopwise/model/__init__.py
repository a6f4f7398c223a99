"""The decoder: :class:`Transformer`, its one constructor :func:`build_model`, and attention set-up."""

from flopwise.model.transformer import Transformer, build_model, configure_attention, init_weights

__all__ = ["Transformer", "build_model", "configure_attention", "init_weights"]
