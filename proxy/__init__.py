"""streamproxy: an OpenAI-compatible streaming server for local language models."""

__version__ = "0.1.0"
