"""tp-run: a drop-in torchrun that keeps training running through worker failures."""

__version__ = "0.1.0"
