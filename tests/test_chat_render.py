"""Tools, tool calls and tool results in prompts (grpo_server/runtime/chat_render.py through PromptBuilder): the
Hermes / Qwen2.5 format for templates that know no tools (the embedded SmolLM2's), a template's own format for
those that do, turn-by-turn continuation, and the checks. No server: the tiny model's tokenizer only."""

from __future__ import annotations

import pytest

from grpo_server.api_models import ChatMessage, CompletionsRequest, Tool
from grpo_server.protocol.errors import BadRequest
from grpo_server.runtime.chat_render import tool_calling_of
from grpo_server.runtime.prompts import PromptBuilder

# Qwen2.5-Instruct's chat template (its tokenizer_config.json), the reference the fallback format follows; its two
# longest string literals are spliced in below, to keep lines short.
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "@INTRO@" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "@OUTRO@" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
           or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
""".replace("@INTRO@", r"\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
                     r"provided with function signatures within <tools></tools> XML tags:\n<tools>").replace(
    "@OUTRO@", r"\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
               r"<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
               r"<args-json-object>}\n</tool_call><|im_end|>\n")

# A small template that shows what it is given: tool names, and calls' arguments as objects (`.city`).
SMALL_TOOLS_TEMPLATE = (
    "{% for t in tools or [] %}[tool {{ t.function.name }}: {{ t.function.parameters.type }}]{% endfor %}"
    "{% for m in messages %}<{{ m.role }}|{{ m.content if m.content is not none else 'NULL' }}"
    "{% for c in m.tool_calls or [] %} call {{ c.id }} {{ c.function.name }}({{ c.function.arguments.city }})"
    "{% endfor %}{% if m.tool_call_id %} for {{ m.tool_call_id }}{% endif %}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant|{% endif %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [Tool.model_validate(WEATHER), Tool.model_validate(TIME)]


def call(call_id: str, city: str, arguments: str | None = None) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": arguments or f'{{"city": "{city}"}}'}}


def messages(*items: dict) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in items]


SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
USER = {"role": "user", "content": "Weather in Paris and Rome?"}
CALLS = {"role": "assistant", "content": None, "tool_calls": [call("c1", "Paris"), call("c2", "Rome")]}
RESULTS = [{"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"},
           {"role": "tool", "tool_call_id": "c2", "content": "21 C"}]
CONVERSATION = messages(SYSTEM, USER, CALLS, *RESULTS)

TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
    '{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}\n'
    "</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
CALLS_TEXT = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
EXPECTED_SMOLLM2 = (
    f"<|im_start|>system\nYou are a helpful assistant.\n\n{TOOLS_PROMPT}<|im_end|>\n"
    "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
    f"<|im_start|>assistant\n{CALLS_TEXT}<|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>\n"
    "<tool_response>\n21 C\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def builder(tiny_model_dir) -> PromptBuilder:
    """The tiny model's tokenizer: the embedded SmolLM2's plain ChatML template, which knows no tools."""
    return PromptBuilder(tiny_model_dir, max_model_len=4096)


def builder_with_template(tiny_model_dir, template: str) -> PromptBuilder:
    built = PromptBuilder(tiny_model_dir, max_model_len=4096)  # its own tokenizer: the template change stays here
    built.tokenizer.chat_template = template
    return built


@pytest.fixture(scope="module")
def qwen(tiny_model_dir) -> PromptBuilder:
    return builder_with_template(tiny_model_dir, QWEN25_TEMPLATE)


def text(built: PromptBuilder, ids: list[int]) -> str:
    return built.decode(ids)


# --- the Hermes fallback -------------------------------------------------------------------------------------


def test_hermes_fallback_renders_tools_calls_and_results(builder, tokenizer):
    ids = builder.render_messages(CONVERSATION, tools=TOOLS)
    assert text(builder, ids) == EXPECTED_SMOLLM2
    # Rendered through the model's own template: the same ids as its template gives that text's messages.
    as_plain = [{"role": "system", "content": f"You are a helpful assistant.\n\n{TOOLS_PROMPT}"},
                USER, {"role": "assistant", "content": CALLS_TEXT},
                {"role": "user", "content": "<tool_response>\n18 C, sunny\n</tool_response>\n"
                                            "<tool_response>\n21 C\n</tool_response>"}]
    assert ids == tokenizer.apply_chat_template(as_plain, add_generation_prompt=True, tokenize=True)["input_ids"]


def test_hermes_fallback_without_a_system_message_and_with_content(builder):
    history = messages(USER, {**CALLS, "content": "Let me look."}, *RESULTS,
                       {"role": "assistant", "content": "Paris 18 C, Rome 21 C."},
                       {"role": "user", "content": "Thanks"})
    rendered = text(builder, builder.render_messages(history, tools=TOOLS[:1]))
    tools_prompt = TOOLS_PROMPT.replace(
        '\n{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}',
        "")
    # The tools are a new first system message, in place of the template's default system prompt.
    assert rendered.startswith(f"<|im_start|>system\n{tools_prompt}<|im_end|>\n<|im_start|>user\nWeather")
    assert "SmolLM" not in rendered
    assert f"<|im_start|>assistant\nLet me look.\n{CALLS_TEXT}<|im_end|>\n" in rendered
    assert rendered.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\nParis 18 C, Rome 21 C.<|im_end|>\n"
                             "<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n")


def test_history_with_tool_turns_but_no_tools_offered(builder):
    rendered = text(builder, builder.render_messages(CONVERSATION))
    assert "# Tools" not in rendered and CALLS_TEXT in rendered and "<tool_response>\n21 C\n" in rendered
    assert rendered.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")


def test_without_tools_the_rendering_is_unchanged(builder, tokenizer):
    plain = [SYSTEM, USER, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And Rome?"}]
    expected = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert builder.render_messages(messages(*plain)) == expected


def test_fallback_is_qwen25s_format(builder, qwen):
    """With a system message, the fallback's text is exactly what Qwen2.5's own template writes."""
    assert text(qwen, qwen.render_messages(CONVERSATION, tools=TOOLS)) == EXPECTED_SMOLLM2
    with_content = messages(SYSTEM, USER, {**CALLS, "content": "Checking."}, *RESULTS[:1])
    assert text(qwen, qwen.render_messages(with_content, tools=TOOLS)) == \
        text(builder, builder.render_messages(with_content, tools=TOOLS))


# --- a template that knows tools -----------------------------------------------------------------------------


def test_template_with_tools_gets_them_and_openai_messages(tiny_model_dir):
    small = builder_with_template(tiny_model_dir, SMALL_TOOLS_TEMPLATE)
    rendered = text(small, small.render_messages(CONVERSATION, tools=TOOLS))
    assert rendered == ("[tool get_weather: object][tool get_time: object]"
                        "<system|You are a helpful assistant.><user|Weather in Paris and Rome?>"
                        "<assistant|NULL call c1 get_weather(Paris) call c2 get_weather(Rome)>"
                        "<tool|18 C, sunny for c1><tool|21 C for c2><assistant|")
    assert text(small, small.render_messages(messages(USER))) == "<user|Weather in Paris and Rome?><assistant|"


# --- continuation ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("template", ["smollm2", "qwen25"])
def test_continue_conversation_with_tool_turns_is_the_full_renders_tail(builder, qwen, template):
    built = builder if template == "smollm2" else qwen
    prompt = built.render_messages(CONVERSATION[:2], tools=TOOLS)
    # The model's turn as it would sample it: the calls, then end-of-turn.
    completion = built.encode(CALLS_TEXT) + [built.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    continued = built.continue_conversation(prompt + completion, CONVERSATION[3:], tools=TOOLS)
    assert continued == built.render_messages(CONVERSATION, tools=TOOLS)
    # Without the tools (tokenize's continue_from has none): the same ids, the tools are in the prompt already.
    assert built.continue_conversation(prompt + completion, CONVERSATION[3:]) == continued
    # More turns after the results: an assistant answer with calls, a user turn.
    longer = CONVERSATION + messages({**CALLS, "content": "Again.", "tool_calls": [call("c3", "Oslo")]},
                                     {"role": "tool", "tool_call_id": "c3", "content": "2 C"})
    full = built.render_messages(longer, tools=TOOLS)
    head = built.render_messages(CONVERSATION, tools=TOOLS)
    sampled = built.encode('Again.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert built.continue_conversation(head + sampled, longer[-1:], tools=TOOLS) == full


# --- checks -------------------------------------------------------------------------------------------------


def bad(code: str, fn, *args, **kwargs) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        fn(*args, **kwargs)
    assert info.value.code == code and info.value.status == 400, info.value.message
    return info.value


@pytest.mark.parametrize("template", ["smollm2", "qwen25"])
def test_unknown_tool_call_id(builder, qwen, template):
    built = builder if template == "smollm2" else qwen
    error = bad("unknown_tool_call_id", built.render_messages,
                messages(SYSTEM, USER, CALLS, {"role": "tool", "tool_call_id": "c9", "content": "?"}), tools=TOOLS)
    assert "messages.3" in error.message and "c9" in error.message
    bad("unknown_tool_call_id", built.render_messages, messages(USER, *RESULTS[:1]))  # no call before it
    # A continuation's results answer calls in its token ids: not checked.
    prompt = built.render_messages(messages(USER))
    assert built.continue_conversation(prompt + built.encode(CALLS_TEXT), messages(*RESULTS))


@pytest.mark.parametrize("arguments", ["not json", "[1, 2]", '"Paris"', "null", '{"city": "Paris"'])
@pytest.mark.parametrize("template", ["smollm2", "qwen25"])
def test_bad_tool_arguments(builder, qwen, template, arguments):
    built = builder if template == "smollm2" else qwen
    history = messages(USER, {**CALLS, "tool_calls": [call("c1", "", arguments)]})
    error = bad("bad_tool_arguments", built.render_messages, history, tools=TOOLS)
    assert "messages.1.tool_calls.0" in error.message
    bad("bad_tool_arguments", built.continue_conversation, built.render_messages(messages(USER)), history[1:])


@pytest.mark.parametrize("parameters, problem", [
    ({"type": "array", "items": {"type": "string"}}, "object"),
    ({"type": "object", "properties": ["city"]}, "properties"),
    ({"type": "object", "properties": {"city": {"type": "str"}}}, "parameters.properties.city.type"),
    ({"type": "object", "properties": {"city": "string"}}, "parameters.properties.city"),
    ({"type": "object", "required": "city"}, "required"),
    ({"type": "object", "properties": {"cities": {"type": "array", "items": {"type": 3}}}}, "items"),
])
def test_bad_tool_schema(builder, qwen, parameters, problem):
    tools = [Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": parameters}})]
    for built in (builder, qwen):
        error = bad("bad_tool_schema", built.render_messages, messages(USER), tools=tools)
        assert problem in error.message and "tools.0 (f)" in error.message


def test_good_tool_schemas_pass(builder):
    tools = [Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": True, "b": {"type": ["string", "null"]},
                                         "c": {"type": "array", "items": {"type": "object", "properties": {}}}},
        "required": ["a"], "additionalProperties": False}}}),
             Tool.model_validate({"type": "function", "function": {"name": "g"}})]  # parameters default: {}
    assert builder.render_messages(messages(USER), tools=tools)


def test_duplicate_tool(builder, qwen):
    for built in (builder, qwen):
        error = bad("duplicate_tool", built.render_messages, messages(USER), tools=[TOOLS[0], TOOLS[1], TOOLS[0]])
        assert "tools.2" in error.message and "get_weather" in error.message


def test_tool_choice_checks():
    def request(**fields) -> CompletionsRequest:
        return CompletionsRequest.model_validate({"messages": [USER], **fields})

    assert tool_calling_of(request()) is None
    assert tool_calling_of(request(tool_choice="none")) is None
    assert tool_calling_of(request(tools=[WEATHER], tool_choice="none")) is None
    calling = tool_calling_of(request(tools=[WEATHER, TIME], parallel_tool_calls=False))
    assert (calling.choice, calling.function, calling.parallel) == ("auto", None, False)
    named = tool_calling_of(request(tools=[WEATHER], tool_choice={"type": "function",
                                                                  "function": {"name": "get_weather"}}))
    assert (named.choice, named.function, named.parallel) == ("named", "get_weather", True)
    bad("unknown_tool", tool_calling_of, request(tools=[WEATHER], tool_choice={"type": "function",
                                                                                "function": {"name": "nope"}}))
    bad("tools_missing", tool_calling_of, request(tool_choice="required"))


def test_a_template_that_refuses_is_a_400(tiny_model_dir):
    refusing = builder_with_template(tiny_model_dir, "{{ raise_exception('roles must alternate') }}")
    error = bad("chat_template_error", refusing.render_messages, messages(USER))
    assert "roles must alternate" in error.message
