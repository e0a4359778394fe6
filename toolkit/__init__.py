"""A strategy comparison toolkit for fine-tuning transformer models in PyTorch."""

__version__ = "0.1.0"
