"""Tool calls on the vLLM engine, with vLLM's own machinery: the tool parser named by
`SamplerOptions.tool_parser` (as vLLM's --tool-call-parser) reads a completion's calls out of its text,
and for `required` / `named` (and `parallel=False`) the parser's structural tag (xgrammar) constrains the
output through structured outputs, so that the completion is a call in the parser's format, its
arguments following the function's JSON schema. Nothing here parses or writes a grammar by hand.

Each request becomes the vLLM `ChatCompletionRequest` the parser and the tag builder expect (no
messages: the prompt is already token ids), and goes through the same steps as in vLLM's OpenAI server
(vllm/parser/abstract_parser.py `_apply_structural_tag`, then the parser's `adjust_request`), with one
difference: a function without `strict` follows its schema when a call is forced (vLLM leaves its
arguments free unless the server runs at --tool-strict-level parameter); `strict: false` frees them.
And one addition to vLLM's tag: runs of whitespace inside the arguments are capped
(`MAX_ARGUMENT_WHITESPACE`). Unbounded, they are the one free choice the grammar leaves between JSON
tokens, and a model that likes whitespace tokens (the tests' random one did) fills max_tokens with them
without ever closing the call; xgrammar's own builders offer this cap for that reason. Hermes-format
arguments are one line of JSON (chat templates render them with tojson), which a cap of 2 leaves alone.

Calls to a function that was not offered are kept (with `auto`, the grammar cannot stop them): the
client sees what the model wrote, and a reward can punish it.

What the constraint does to the logprobs: vllm_engine.py, `_completion`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from grpo_server.protocol.errors import BadRequest
from grpo_server.protocol.wire import ToolCall, ToolCalling

# Most consecutive whitespace characters inside a call's arguments (see the module docstring).
MAX_ARGUMENT_WHITESPACE = 2


@dataclass
class ToolRequest:
    """One request's tool calling on vLLM's side: its parser, and what the parser asked for."""

    parser: Any  # a vllm ToolParser, with the request's tools
    request: Any  # the vllm ChatCompletionRequest it parses against
    structured_outputs: Any  # vllm StructuredOutputsParams, or None: the output is free

    @property
    def decode_special_tokens(self) -> bool:
        # Hermes' parser asks for special tokens in the text: its <tool_call> is one in some models.
        return not self.request.skip_special_tokens


class ToolCalls:
    """The configured vLLM tool parser. Built at engine start: an unknown name fails the sampler there."""

    def __init__(self, parser_name: str, tokenizer: Any) -> None:
        from vllm.tool_parsers import ToolParserManager

        try:
            self._parser_class = ToolParserManager.get_tool_parser(parser_name)
        except KeyError:
            known = ", ".join(ToolParserManager.list_registered())
            raise ValueError(f"sampler.tool_parser {parser_name!r} is not one of vLLM's tool parsers: "
                             f"{known}") from None
        self.parser_name = parser_name
        self._tokenizer = tokenizer
        self._parser_class(tokenizer)  # some parsers look their markers up in the vocabulary: fail at start

    def prepare(self, calling: ToolCalling) -> ToolRequest:
        """The parser and the output constraint for one request; BadRequest for what cannot be served."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import StructuredOutputsParams
        from vllm.tool_parsers.structural_tag_registry import limit_to_single_tool_call
        from vllm.tool_parsers.tool_strict_level import ToolStrictLevel

        forced = calling.choice != "auto"
        if calling.choice == "named" and not calling.function:
            raise BadRequest("tool_calling: choice 'named' needs `function`")
        tools = []
        for tool in calling.tools:
            function = tool.model_dump(exclude_none=True)
            if forced and tool.strict is None:
                function["strict"] = True
            tools.append({"type": "function", "function": function})
        choice: Any = calling.choice
        if calling.choice == "named":
            choice = {"type": "function", "function": {"name": calling.function}}
        try:
            request = ChatCompletionRequest(messages=[], tools=tools, tool_choice=choice,
                                            parallel_tool_calls=calling.parallel)
        except (ValueError, VLLMClientError) as exc:  # pydantic's and vLLM's (a named function not offered)
            raise BadRequest(f"tool_calling: {exc}") from exc
        parser = self._parser_class(self._tokenizer, request.tools)
        # As vLLM's server: the call envelope is constrained when a call is forced or limited to one, and a
        # tool's arguments when it is strict; with `auto` and no strict tool there is no constraint.
        needs_grammar = forced or not calling.parallel
        level = ToolStrictLevel.FUNCTION if needs_grammar else ToolStrictLevel.AUTO
        try:
            tag = parser.get_structural_tag(request, strict_level=level)
        except (ValueError, VLLMClientError) as exc:
            raise BadRequest(f"tool_calling: {exc}") from exc
        if tag is None and needs_grammar:
            raise BadRequest(
                f"tool parser {self.parser_name!r} has no structural tag in vLLM, so choice {calling.choice!r} "
                f"with parallel={calling.parallel} cannot be enforced; use choice 'auto' with parallel calls",
                code="tools_unsupported",
            )
        if tag is not None:
            if not calling.parallel:
                limit_to_single_tool_call(tag)
            _cap_whitespace(tag.format)
            request.structured_outputs = StructuredOutputsParams(structural_tag=json.dumps(tag.model_dump()))
        request = parser.adjust_request(request)
        return ToolRequest(parser=parser, request=request, structured_outputs=request.structured_outputs)

    def parse(self, tools: ToolRequest, text: str, token_ids: list[int], ended_by_token: bool,
              stop_string: str | None) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of one completion. `text` is the completion's text (special tokens skipped);
        the parser reads it, or, when it asks for special tokens, the token ids decoded with them (less
        the token that ended the completion, EOS, which vLLM leaves out of its text too)."""
        model_output = text
        if tools.decode_special_tokens:
            ids = token_ids[:-1] if ended_by_token else token_ids
            model_output = self._tokenizer.decode(ids, skip_special_tokens=False)
            if stop_string and (cut := model_output.find(stop_string)) >= 0:
                model_output = model_output[:cut]
        found = tools.parser.extract_tool_calls(model_output, tools.request)
        if not found.tools_called or not found.tool_calls:
            return text, []  # no call: the content is the text as the completion reports it
        calls = [ToolCall(id=call.id, name=call.function.name, arguments=call.function.arguments)
                 for call in found.tool_calls]
        return found.content or None, calls


def _cap_whitespace(node: Any) -> None:
    """Cap whitespace runs in every JSON content of a structural tag (in place), where vLLM left them free."""
    from pydantic import BaseModel
    from xgrammar.structural_tag import JSONSchemaFormat

    if isinstance(node, JSONSchemaFormat) and node.max_whitespace_cnt is None:
        node.max_whitespace_cnt = MAX_ARGUMENT_WHITESPACE
    if isinstance(node, BaseModel):
        for name in type(node).model_fields:
            _cap_whitespace(getattr(node, name))
    elif isinstance(node, (list, tuple)):
        for item in node:
            _cap_whitespace(item)
