"""Chat requests with tools: how tools, tool calls and tool results become the prompt (`chat_inputs`), their
checks, and what the sampler is asked to parse or enforce (`tool_calling_of`).

**A chat template that knows tools** (its source uses `tools`, as Qwen2.5's does) renders them itself:
`apply_chat_template(messages, tools=[{"type": "function", "function": {...}}, ...])`, the messages as OpenAI
dicts, except that a call's `arguments` is the parsed JSON object, as Hugging Face templates expect.

**Any other template** (the embedded SmolLM2's is plain ChatML) gets the Hermes / Qwen2.5 format, written
as ordinary messages and rendered by the model's own template, so that its text is what Qwen2.5's template
writes and vLLM's `hermes` tool parser reads:

- the tools go into the system prompt: appended to the client's first system message after a blank line, or
  as a new first system message (which replaces the template's default system prompt, if it has one)::

      # Tools

      You may call one or more functions to assist with the user query.

      You are provided with function signatures within <tools></tools> XML tags:
      <tools>
      {"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}
      </tools>

      For each function call, return a json object with function name and arguments within \
      <tool_call></tool_call> XML tags:
      <tool_call>
      {"name": <function-name>, "arguments": <args-json-object>}
      </tool_call>

  (one line of JSON per tool inside `<tools>`; the line cut by a backslash here is one line);
- an assistant turn with tool calls: its content (if any), then per call, each on a new line,
  `<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>`;
- `tool` messages: a user turn holding one `<tool_response>\\n{content}\\n</tool_response>` block per
  message, consecutive tool messages together, separated by newlines.

Arguments and tools are written with `json.dumps(..., ensure_ascii=False)`, as transformers' `tojson`.

Checks (each a 400 with its code): a call's `arguments` must be a JSON object (`bad_tool_arguments`); a
`tool` message must answer a call of an earlier assistant message (`unknown_tool_call_id`; not checked for
the new turns of a continuation, whose calls are in the token ids); tool names are unique
(`duplicate_tool`); a tool's `parameters` must look like a JSON schema of an object (`bad_tool_schema`: a
structural check, not a full JSON-schema validation: `jsonschema` is no base dependency). And in
`tool_calling_of`: a named function must be one of the tools (`unknown_tool`), and tool_choice "required"
or named needs tools (`tools_missing`).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from grpo_server.api_models import ChatMessage, CompletionsRequest, MessageToolCall, NamedToolChoice, Tool
from grpo_server.protocol.errors import BadRequest
from grpo_server.protocol.wire import ToolCalling

TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)
JSON_TYPES = {"string", "number", "integer", "boolean", "array", "object", "null"}


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# --- checks ------------------------------------------------------------------------------------------------


MAX_SCHEMA_DEPTH = 32  # deeper nesting would only exhaust the recursion below (and the grammar compiler)


def _schema_problem(schema: Any, where: str, depth: int = 0) -> str | None:
    """Why `schema` is not a usable JSON schema, structurally (None if it looks fine)."""
    if not isinstance(schema, dict):
        return f"{where} must be an object"
    if depth > MAX_SCHEMA_DEPTH:
        return f"{where} nests schemas more than {MAX_SCHEMA_DEPTH} deep"
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if not all(isinstance(k, str) and k in JSON_TYPES for k in kinds):
        return f"{where}.type must be one of {sorted(JSON_TYPES)} (or a list of them), not {kind!r}"
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        return f"{where}.properties must be an object mapping names to schemas"
    for name, sub in properties.items():
        if isinstance(sub, bool):  # true / false are schemas too (anything / nothing)
            continue
        if problem := _schema_problem(sub, f"{where}.properties.{name}", depth + 1):
            return problem
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return f"{where}.required must be a list of property names"
    if "items" in schema and not isinstance(schema["items"], bool):
        return _schema_problem(schema["items"], f"{where}.items", depth + 1)
    return None


def check_tools(tools: Sequence[Tool]) -> None:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        function = tool.function
        if function.name in seen:
            raise BadRequest(f"tools.{i}: a second tool named {function.name!r}: tool names must be unique",
                             code="duplicate_tool")
        seen.add(function.name)
        schema = function.parameters
        # The model is told to answer with an arguments *object*: the schema must describe one.
        problem = "its type must be \"object\"" if schema.get("type", "object") != "object" else None
        if problem := problem or _schema_problem(schema, "parameters"):
            raise BadRequest(f"tools.{i} ({function.name}): 'parameters' is not a JSON schema of an object: "
                             f"{problem}", code="bad_tool_schema")


def call_arguments(call: MessageToolCall, where: str) -> dict[str, Any]:
    """A history call's arguments, parsed: a JSON object, or a 400."""
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise BadRequest(f"{where}.function.arguments must be a JSON object (as text), not "
                         f"{call.function.arguments[:80]!r}", code="bad_tool_arguments")
    return arguments


def check_tool_call_ids(messages: Sequence[ChatMessage]) -> None:
    called: set[str] = set()
    for i, message in enumerate(messages):
        called.update(call.id for call in message.tool_calls or ())
        if message.role == "tool" and message.tool_call_id not in called:
            raise BadRequest(f"messages.{i}: tool_call_id {message.tool_call_id!r} answers no tool call of an "
                             "earlier assistant message", code="unknown_tool_call_id")


# --- rendering ---------------------------------------------------------------------------------------------


def template_knows_tools(chat_template: str | dict[str, str] | None) -> bool:
    sources = chat_template.values() if isinstance(chat_template, dict) else [chat_template or ""]
    return any("tools" in source for source in sources)


def tool_schemas(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The tools as a chat template sees them (`strict` is for the sampler's constraint, not the model)."""
    return [{"type": "function", "function": tool.function.model_dump(exclude_none=True, exclude={"strict"})}
            for tool in tools]


def _openai_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for i, message in enumerate(messages):
        item: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            item["tool_calls"] = [
                {"id": call.id, "type": "function", "function": {
                    "name": call.function.name, "arguments": call_arguments(call, f"messages.{i}.tool_calls.{j}")}}
                for j, call in enumerate(message.tool_calls)]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        out.append(item)
    return out


def hermes_call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{_dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _hermes_dicts(messages: Sequence[ChatMessage], tools: Sequence[Tool] | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    previous_tool = False
    for i, message in enumerate(messages):
        if message.role == "tool":
            block = f"<tool_response>\n{message.content}\n</tool_response>"
            if previous_tool:  # consecutive results share one user turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            previous_tool = True
            continue
        previous_tool = False
        content = message.content
        if message.tool_calls:
            calls = [hermes_call(call.function.name, call_arguments(call, f"messages.{i}.tool_calls.{j}"))
                     for j, call in enumerate(message.tool_calls)]
            content = "\n".join(([content] if content else []) + calls)
        out.append({"role": message.role, "content": content})
    if tools:
        prompt = TOOLS_PROMPT.format(tools="".join("\n" + _dumps(schema) for schema in tool_schemas(tools)))
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{prompt}"
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def chat_inputs(chat_template: str | dict[str, str] | None, messages: Sequence[ChatMessage],
                tools: Sequence[Tool] | None = None, *, continuation: bool = False
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for `apply_chat_template`, after the checks. `continuation`: the messages follow an
    earlier exchange (their tool results may answer calls in it; the tools' system prompt belongs to it)."""
    if tools:
        check_tools(tools)
    if not continuation:
        check_tool_call_ids(messages)
    if template_knows_tools(chat_template):
        return _openai_dicts(messages), tool_schemas(tools) if tools else None
    return _hermes_dicts(messages, None if continuation else tools), None


# --- the sampler's part ------------------------------------------------------------------------------------


def tool_calling_of(request: CompletionsRequest) -> ToolCalling | None:
    """The sampler's part of a request's tools: None without tools or with tool_choice "none" (the tools are
    still shown to the model, as OpenAI does, but its text is not parsed)."""
    choice = request.tool_choice
    if not request.tools:
        if choice is not None and choice not in ("none", "auto"):  # ignoring it would hide that no call comes
            raise BadRequest("tool_choice \"required\" or a named function needs 'tools'", code="tools_missing")
        return None
    if choice == "none":
        return None
    functions = [tool.function for tool in request.tools]
    parallel = request.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        name = choice.function.get("name")
        if name not in {f.name for f in functions}:
            raise BadRequest(f"tool_choice names the function {name!r}, which is not in 'tools'",
                             code="unknown_tool")
        return ToolCalling(tools=functions, choice="named", function=name, parallel=parallel)
    return ToolCalling(tools=functions, choice=choice or "auto", parallel=parallel)
