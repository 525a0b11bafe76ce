"""The MCP server of `grpo-server mcp`: its tools, each one or a few calls of a running grpo_server's HTTP API with
the key it was started with, and the server's refusals as tool errors an agent can act on.

    grpo-server mcp --url http://127.0.0.1:8000        # the key from GRPO_SERVER_API_KEY; stdio
"""

from __future__ import annotations

import asyncio
import functools
from typing import Annotated, Any, Awaitable, Callable, Literal, ParamSpec

import aiohttp
import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import Field

from grpo_server.client import AsyncClient, GrpoServerError
from grpo_server.config import EXPERIMENT_NAME
from grpo_server.mcp import views

Transport = Literal["stdio", "streamable-http"]
P = ParamSpec("P")
# Checked here as the server checks it, so that a name is only ever one segment of the API's paths.
Name = Annotated[str, Field(pattern=EXPERIMENT_NAME, description="The experiment's name ([a-z0-9_-], 1-64)")]

RATED_MOST = 32  # what the server keeps of each experiment (grpo_server/runtime/rated.py RATED_KEPT)
CURVE_MOST = 500
METRICS_MOST = 200
# Creating or deleting an experiment loads or archives its adapter on every worker: seconds, not minutes.
TIMEOUT_S = 120.0

READ = ToolAnnotations(read_only_hint=True, open_world_hint=False)
CHANGE = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
CREATE = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False, open_world_hint=False)
DELETE = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=False, open_world_hint=False)

INSTRUCTIONS = (
    "Operates a grpo_server: a GRPO training service where clients sample completions from an experiment (a LoRA "
    "adapter on a shared base model), score them and post rewards, and the server trains. Start with "
    "list_experiments, then experiment_status for one (its reward curve, train and push metrics) and rated_groups "
    "to read what the model wrote and how it was scored. create_experiment, pause_experiment, unpause_experiment "
    "and delete_experiment need the admin key; with an experiment's key only its own experiment is visible.")

ADMIN_ONLY = ("creating, pausing, unpausing and deleting experiments needs the admin key, and this MCP server was "
              "started with an experiment's key")


def tool_error(exc: GrpoServerError) -> ToolError:
    """The server's refusal, worded for an agent: what to do about it first, the server's own words after."""
    answered = f"(the server answered {exc.status} {exc.code}: {exc.message})"
    if exc.status == 401:
        return ToolError(f"the server does not accept this MCP server's key: check its --api-key or "
                         f"GRPO_SERVER_API_KEY {answered}")
    if exc.status == 403 and exc.code == "admin_only":
        return ToolError(f"refused: {ADMIN_ONLY} {answered}")
    if exc.status == 403:
        return ToolError(f"refused: this key reaches one experiment only, its own (list_experiments shows it) "
                         f"{answered}")
    if exc.status == 404:
        return ToolError(f"not found {answered}")
    retry = f"; retry in {exc.retry_after:g} s" if exc.retry_after is not None else ""
    return ToolError(f"failed {answered}{retry}")


def server_errors(url: str, tool: Callable[P, Awaitable[dict[str, Any]]]) -> Callable[P, Awaitable[dict[str, Any]]]:
    """`tool`, with the server's refusals and an unreachable server raised as ToolError: the agent reads their text
    (any other exception reaches it as a bare "Error executing tool")."""

    @functools.wraps(tool)
    async def guarded(*args: P.args, **kwargs: P.kwargs) -> dict[str, Any]:
        try:
            return await tool(*args, **kwargs)
        except GrpoServerError as exc:
            raise tool_error(exc) from exc
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            raise ToolError(f"cannot reach the grpo_server at {url} ({type(exc).__name__}: {exc}); is it running, "
                            "and is --url / GRPO_SERVER_URL right?") from exc

    return guarded


class Operator:
    """The tools: each a method, its docstring the description an agent reads."""

    def __init__(self, client: AsyncClient):
        self.client = client

    async def server_health(self) -> dict[str, Any]:
        """The server's health: 'ok' or 'degraded', its workers' states (sampler, learner) and the base model."""
        return views.health(await self.client.health())

    async def list_experiments(self) -> dict[str, Any]:
        """The experiments this key sees (the admin key: all; an experiment's key: its own), each with its state,
        whether it is paused, its serving policy version and learner step, its mean reward over the last rated
        groups, and its group counters."""
        return {"experiments": [views.experiment_summary(s) for s in await self.client.list_experiments()]}

    async def experiment_status(self, name: Name,
                                curve_points: Annotated[int, Field(ge=1, le=CURVE_MOST)] = 50) -> dict[str, Any]:
        """One experiment's status and progress: state, paused, versions, counters, errors, the main config, its
        reward curve (mean reward of each of the last `curve_points` train steps, oldest first), and the newest
        train step's metrics (loss, KL, grad norm), push (version and its check's verdict) and sampling
        throughput."""
        status, train, pushes, sampling = await asyncio.gather(
            self.client.status(name), self.client.metrics(name, "train", curve_points),
            self.client.metrics(name, "push", 1), self.client.metrics(name, "sampling", 1))
        return views.experiment_details(status, train, pushes, sampling)

    async def experiment_metrics(self, name: Name, kind: Literal["train", "push", "sampling"] | None = None,
                                 limit: Annotated[int, Field(ge=1, le=METRICS_MOST)] = 20) -> dict[str, Any]:
        """The newest records of an experiment's metrics log, oldest first: `train` (one per learner step: loss,
        reward_mean/std, kl, mismatch_kl, clipped_fraction, grad_norm, tokens, step_seconds), `push` (a new version
        served, with its check's verdict) or `sampling` (throughput every 10 s while it samples); every kind if
        `kind` is left out."""
        return {"name": name, "records": views.metrics_records(await self.client.metrics(name, kind, limit))}

    async def rated_groups(self, name: Name, limit: Annotated[int, Field(ge=1, le=RATED_MOST)] = 5) -> dict[str, Any]:
        """The experiment's newest rated groups and episodes, oldest first: for each, its kind (sampled, external
        or episodes), the end of its prompt, its completions' texts (clipped to 500 characters, 16 a group at
        most) or its episodes' transcript ends, the rewards the client posted and the advantages they train
        with (or why it was skipped, e.g. zero_variance). The server keeps the newest 32, in memory only."""
        groups = await self.client.rated_groups(name, limit)
        return {"name": name, "groups": [views.rated_group(g) for g in groups]}

    async def create_experiment(self, name: Name, config: dict[str, Any] | None = None,
                                resume: bool = False) -> dict[str, Any]:
        """Create an experiment (admin key). `name`: [a-z0-9_-], 1-64 characters. `config`: the experiment's
        settings besides its name, as JSON, e.g. {"sampling": {"n": 8, "max_tokens": 256}, "algorithm":
        {"batch_groups": 4, "learning_rate": 1e-5}, "lora": {"r": 16}}; what it leaves out takes the defaults.
        `resume`: bring back the deleted experiment of this name (weights, step, versions) instead of starting
        afresh. Answers its status and `api_key`: the key the server made when the config gave none, shown this
        once (the experiment's client needs it)."""
        created = await self.client.create_experiment({**(config or {}), "name": name}, resume=resume)
        return {**views.experiment_summary(created), "api_key": created.api_key}

    async def pause_experiment(self, name: Name) -> dict[str, Any]:
        """Pause an experiment (admin key): it samples nothing and trains no batch, nor any Tinker call, until
        unpause_experiment (its clients get 503 experiment_paused and wait); feedback for groups sampled before is
        still taken. The pause outlasts a server restart."""
        return views.experiment_summary(await self.client.pause_experiment(name))

    async def unpause_experiment(self, name: Name) -> dict[str, Any]:
        """Unpause a paused experiment (admin key): it samples and trains again."""
        return views.experiment_summary(await self.client.unpause_experiment(name))

    async def delete_experiment(self, name: Name) -> dict[str, Any]:
        """Delete an experiment (admin key): it stops serving and training at once, its key stops working and its
        files are archived; a new experiment of its name starts afresh, and create_experiment(name, resume=true)
        brings the archived one back. Confirm with the operator first."""
        await self.client.delete_experiment(name)
        return {"deleted": name}


def build_server(client: AsyncClient) -> MCPServer:
    """The MCP server whose tools call the grpo_server `client` reaches, with its key."""
    server: MCPServer = MCPServer("grpo-server", instructions=INSTRUCTIONS)
    operator = Operator(client)
    tools = ((operator.server_health, READ), (operator.list_experiments, READ), (operator.experiment_status, READ),
             (operator.experiment_metrics, READ), (operator.rated_groups, READ),
             (operator.create_experiment, CREATE), (operator.pause_experiment, CHANGE),
             (operator.unpause_experiment, CHANGE), (operator.delete_experiment, DELETE))
    for tool, annotations in tools:
        server.add_tool(server_errors(client.base_url, tool), annotations=annotations)
    return server


def run(url: str, api_key: str, transport: Transport = "stdio", host: str = "127.0.0.1", port: int = 8765) -> None:
    """Serve until the agent closes stdin (stdio) or the process is stopped (streamable HTTP at
    http://HOST:PORT/mcp, with no key of its own: whoever reaches it acts with `api_key`)."""

    async def serve() -> None:
        client = AsyncClient(url, api_key, timeout_s=TIMEOUT_S)
        server = build_server(client)
        try:
            if transport == "stdio":
                await server.run_stdio_async()
            else:
                await server.run_streamable_http_async(host=host, port=port)
        finally:
            await client.close()

    anyio.run(serve)
