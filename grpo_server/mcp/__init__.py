"""`grpo-server mcp`: a Model Context Protocol server for operators, so that a coding agent can watch and run
training jobs (docs/guides/mcp.md).

It is a client of a running grpo_server, not a part of it: each tool is one or two calls of the HTTP API through
`grpo_server.client.AsyncClient`, with the key it was started with (`--api-key` / `GRPO_SERVER_API_KEY`, the
server at `--url` / `GRPO_SERVER_URL`). So the server decides what a key may see and do, as for any client: the
admin key sees every experiment and may create, pause and delete them; an experiment's key sees its own only, and
the server's refusal (403) comes back as the tool's error, worded for the agent.

- `server.py`: the MCP server (the official `mcp` SDK's `MCPServer`), its tools and their errors; stdio by default
  (what an agent launches), streamable HTTP on request.
- `views.py`: what a tool answers, from the API's models: compact, bounded data (the newest few groups, the
  reward curve's last points), numbers rounded.

Needs the `mcp` extra (`pip install 'grpo-server[mcp]'`); the rest of the package does not import it.
"""
