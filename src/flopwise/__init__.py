"""flopwise: pretrain 100M-2B language models with performance discipline."""

__version__ = "0.1.0"
