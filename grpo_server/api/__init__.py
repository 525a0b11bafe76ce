"""The public HTTP API: the app, every route's edge and handlers, the OpenAI routes, /openapi.json, /metrics and
the status page. Calls into `runtime`; nothing below imports it."""
