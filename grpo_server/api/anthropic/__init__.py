"""The Anthropic-compatible routes: `POST /v1/messages` and `POST /v1/messages/count_tokens` (routes.py)."""
