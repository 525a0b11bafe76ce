"""vLLM's `POST /tokenize` and `POST /detokenize`, in vLLM 0.32's shapes, for the clients that build token-exact
multi-turn prompts with them (verifiers' interleaved rollouts, prime-rl): they call them at the server's root,
beside `/v1` (vLLM serves them there).

- `/tokenize`: `{model, prompt}` or `{model, messages, add_generation_prompt?, tools?}` ->
  `{count, max_model_len, tokens, token_strs}` (`token_strs`, the tokenizer's own token strings, with
  `return_token_strs: true`, else null). The ids are the ones completions would use: the request becomes our
  native `TokenizeRequest` and goes through the same prompt builder as `POST /v1/tokenize` and completions.
- `/detokenize`: `{model, tokens}` -> `{prompt}`, decoded as vLLM does (special tokens kept).

`model` names the experiment, as on the other OpenAI-compatible routes (the admin key or the experiment's own
key; another experiment's key is a 403). Of vLLM's other fields, `add_special_tokens` is ignored (the ids are
always what completions use: text with no special tokens added, chat through the model's template), and
`continue_final_message: true`, a `chat_template` and non-empty `chat_template_kwargs` are 400s, as on chat
completions (prompts here are rendered by the model's own template only).
"""

from __future__ import annotations

from typing import Annotated, Any

from aiohttp import web
from pydantic import Field, ValidationError

from grpo_server.api.app_state import ORCHESTRATOR
from grpo_server.api.edge import respond
from grpo_server.api.openai.convert import chat_messages
from grpo_server.api.openai.models import OpenAIBody, OpenAIChatMessage
from grpo_server.api.route_table import Endpoint, Principal
from grpo_server.api_models import TokenizeRequest
from grpo_server.protocol.errors import BadRequest, Unprocessable, describe_validation_error
from grpo_server.runtime.prompts import PromptBuilder


class VllmTokenizeRequest(OpenAIBody):
    """vLLM's two tokenize bodies in one: exactly one of `prompt` (text) and `messages` (chat)."""

    model: str = Field(min_length=1, description="The experiment's name.")
    prompt: str | None = None
    messages: list[OpenAIChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    tools: list[Any] | None = None  # checked as api_models.Tool
    return_token_strs: bool | None = False
    add_special_tokens: bool | None = None  # ignored (see the module docstring)
    continue_final_message: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class VllmTokenizeResponse(OpenAIBody):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class VllmDetokenizeRequest(OpenAIBody):
    model: str = Field(min_length=1, description="The experiment's name.")
    tokens: list[Annotated[int, Field(ge=0)]]


class VllmDetokenizeResponse(OpenAIBody):
    prompt: str


def native_request(body: VllmTokenizeRequest) -> TokenizeRequest:
    """Our own tokenize request for vLLM's body: 400 for what is not served, 422 for what does not parse."""
    if body.continue_final_message:
        raise BadRequest("continue_final_message is not supported: a chat prompt ends in the generation prompt "
                         "or in a whole turn (add_generation_prompt)", code="unsupported_parameter")
    if body.chat_template is not None or body.chat_template_kwargs:
        raise BadRequest("chat_template and chat_template_kwargs are not supported: prompts are rendered by the "
                         "model's own template", code="unsupported_parameter")
    fields: dict[str, Any] = {"prompt": body.prompt}
    if body.messages is not None:
        fields = {"prompt": body.prompt, "messages": chat_messages(body.messages),
                  "add_generation_prompt": body.add_generation_prompt, "tools": body.tools or None}
    try:
        return TokenizeRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise Unprocessable(describe_validation_error(exc), code="invalid_request") from exc


def _token_strs(prompts: PromptBuilder, ids: list[int]) -> list[str]:
    return prompts.tokenizer.convert_ids_to_tokens(ids)  # this tokenizer thread's own copy


def _detokenize(prompts: PromptBuilder, ids: list[int]) -> str:
    prompts.check_ids(ids, "tokens")  # 400 bad_token_ids, as for a prompt's ids
    return prompts.decode(ids)


async def tokenize(request: web.Request, who: Principal, body: VllmTokenizeRequest) -> web.Response:
    orchestrator = request.app[ORCHESTRATOR]
    orchestrator.get(body.model)  # 404 experiment_not_found
    prompts = orchestrator.prompts
    if body.prompt == "" and body.messages is None:
        ids: list[int] = []  # vLLM answers an empty text with no tokens; ours would be a 422 (min_length)
    else:
        ids = (await orchestrator.tokenize(native_request(body))).token_ids
    strs = await prompts.off_loop(_token_strs, prompts, ids) if body.return_token_strs else None
    return respond(request, VllmTokenizeResponse(count=len(ids), max_model_len=prompts.max_model_len, tokens=ids,
                                                 token_strs=strs))


async def detokenize(request: web.Request, who: Principal, body: VllmDetokenizeRequest) -> web.Response:
    orchestrator = request.app[ORCHESTRATOR]
    orchestrator.get(body.model)
    text = await orchestrator.prompts.off_loop(_detokenize, orchestrator.prompts, list(body.tokens))
    return respond(request, VllmDetokenizeResponse(prompt=text))


VLLM_TOKEN_ROUTES: tuple[Endpoint, ...] = (
    Endpoint("POST", "/tokenize", tokenize, VllmTokenizeRequest, VllmTokenizeResponse, 200,
             "vLLM-compatible: a prompt or messages to the token ids completions would use (`model` is the "
             "experiment)", "experiment", operation="post_tokenize_vllm", scope=lambda body: body.model),
    Endpoint("POST", "/detokenize", detokenize, VllmDetokenizeRequest, VllmDetokenizeResponse, 200,
             "vLLM-compatible: token ids to text (`model` is the experiment)", "experiment",
             scope=lambda body: body.model),
)
