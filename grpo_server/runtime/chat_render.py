"""Tools in chat requests: what the sampler is asked to parse or enforce (`tool_calling_of`)."""

from __future__ import annotations

from grpo_server.api_models import CompletionsRequest, NamedToolChoice
from grpo_server.protocol.errors import BadRequest
from grpo_server.protocol.wire import ToolCalling


def tool_calling_of(request: CompletionsRequest) -> ToolCalling | None:
    """The sampler's part of a request's tools: None without tools or with tool_choice "none" (the tools are
    still shown to the model, as OpenAI does, but its text is not parsed)."""
    if not request.tools or request.tool_choice == "none":
        return None
    functions = [tool.function for tool in request.tools]
    parallel = request.parallel_tool_calls is not False
    choice = request.tool_choice
    if isinstance(choice, NamedToolChoice):
        name = choice.function.get("name")
        if name not in {f.name for f in functions}:
            raise BadRequest(f"tool_choice names the function {name!r}, which is not in 'tools'",
                             code="unknown_tool")
        return ToolCalling(tools=functions, choice="named", function=name, parallel=parallel)
    return ToolCalling(tools=functions, choice=choice or "auto", parallel=parallel)
