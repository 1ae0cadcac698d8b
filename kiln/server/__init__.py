"""Kiln's Flask dev server: the chat harness, artifact hosting and an OpenAI-compatible API."""

from .app import ServerConfig, create_app, serve

__all__ = ["ServerConfig", "create_app", "serve"]
