"""vLLM's extensions to OpenAI's sampling bodies, as vLLM 0.32 takes them, and what this server does with each.

Token-exact clients (verifiers, prime-rl, ...) were written against vLLM's server, so they send its fields,
mostly through the SDK's `extra_body`. Three kinds:
- honoured: `return_token_ids` (the answer carries vLLM's token fields: `prompt_token_ids` at the top of a
  chat answer, per choice `token_ids`, and on the legacy completions also per choice `prompt_token_ids`),
  `return_tokens_as_token_ids` (logprob tokens as `token_id:<id>`), and token ids as the legacy `prompt`;
- rejected with 400 unless neutral, because they change which tokens are sampled or how the prompt is
  rendered, and ignoring them would train on samples the client did not ask for (`SAMPLING_NEUTRAL`,
  `CHAT_NEUTRAL`);
- accepted and ignored (not declared here, so dropped with any unknown field): how text is shown
  (`skip_special_tokens`, `spaces_between_special_tokens`, `include_stop_str_in_output`: the text is always
  without special tokens and without the stop string; `token_ids` are exact either way) and bookkeeping
  (`request_id`, `priority`, `cache_salt`, `kv_transfer_params`, `mm_processor_kwargs`, ...).

The mixins below declare them on `models.py`'s request bodies (and so in /openapi.json). No ML imports.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from grpo_server.protocol.errors import BadRequest

# field -> the values that mean "off" (None, its absence, is always neutral)
SAMPLING_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_k": (0, -1),  # vLLM: 0 or -1 is no top-k
    "min_p": (0,),
    "repetition_penalty": (1,),
    "min_tokens": (0,),
    "ignore_eos": (False,),
    "stop_token_ids": ([],),
    "allowed_token_ids": ([],),
    "logprob_token_ids": ([],),
    "use_beam_search": (False,),
    "structured_outputs": ({},),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "prompt_logprobs": (),  # only the sampled tokens' logprobs exist (the sampler scores no prompt)
}
CHAT_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "add_generation_prompt": (True,),  # a chat prompt always ends in the generation prompt here
    "continue_final_message": (False,),
    "echo": (False,),
    "chat_template": (),  # the model's own template renders every prompt (and so what the learner sees)
    "chat_template_kwargs": ({},),
    "documents": ([],),
}


class VllmFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    return_token_ids: bool | None = Field(None, description=(
        "vLLM's: the answer's token ids in vLLM's fields (top-level `prompt_token_ids` on chat, per choice "
        "`token_ids`, and per choice `prompt_token_ids` on the legacy completions)."))
    return_tokens_as_token_ids: bool | None = Field(None, description=(
        "vLLM's: with logprobs, each token as `token_id:<id>`, so that tokens that are not valid text are "
        "still told apart."))
    # Rejected unless neutral (SAMPLING_NEUTRAL).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    logprob_token_ids: list[int] | None = None
    use_beam_search: bool | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prompt_logprobs: int | None = None


class VllmChatFields(BaseModel):
    """vLLM's chat rendering fields; rejected unless neutral (CHAT_NEUTRAL)."""

    model_config = ConfigDict(extra="ignore")

    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    echo: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[Any] | None = None


def _neutral(value: Any, values: tuple[Any, ...]) -> bool:
    return value is None or any(value is v if isinstance(v, bool) else value == v for v in values)


def reject_unless_neutral(body: BaseModel, neutral: dict[str, tuple[Any, ...]]) -> None:
    for field, values in neutral.items():
        if not _neutral(getattr(body, field), values):
            allowed = " or ".join(repr(v) for v in values) if values else "absent (null)"
            raise BadRequest(f"{field} (vLLM's extension) is not supported here: only {allowed}; "
                             "docs/guides/verifiers.md, \"vLLM's extensions\", says which of vLLM's fields are "
                             "honoured",
                             code="unsupported_parameter")
