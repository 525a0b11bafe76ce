"""The OpenAI-compatible API (`routes.py`): chat and text completions, with streams and tools; models."""
