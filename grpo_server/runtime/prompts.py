"""Prompts to token ids, in the front end, so token ids are the single source of truth.

The tokenizer comes from the model folder (transformers, imported lazily: the client install does not
need it). Every completion request is checked here against the vocabulary and the context length
before a sampler sees it. Tools, tool calls and tool results reach the chat template as
`chat_render.chat_inputs` makes them (the template's own tool format, or the Hermes / Qwen2.5 one).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from grpo_server.api_models import ChatMessage, ExternalCompletion, PromptFields, Tool
from grpo_server.protocol.errors import BadRequest
from grpo_server.runtime.chat_render import chat_inputs

# Stand-ins for an earlier exchange when rendering only the turns that follow it.
_EARLIER_USER = "\x00earlier user turn\x00"
_EARLIER_ANSWER = "\x00earlier model turn\x00"
# Tokenising and rendering run on these threads, each with its own copy of the tokenizer (a fast tokenizer's
# truncation and padding settings are state that threads sharing one would race on): 8 MiB of text takes
# 10-20 s here, which on the event loop would stall every other client. Two, so that one tenant's large
# request leaves a thread for everyone else's prompts.
TOKENIZER_THREADS = 2
# Margin on the longest token when bounding a text's tokens from its length (`_check_text_length`): a
# normalizer may drop characters (control characters, accents), so a text can hold more per token than
# the vocabulary's longest token shows.
CHARS_PER_TOKEN_MARGIN = 4
T = TypeVar("T")


class PromptBuilder:
    def __init__(self, model_dir: Path, max_model_len: int, max_prompt_tokens: int | None = None):
        from transformers import AutoTokenizer

        self._shared_tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.vocab_size = len(self._shared_tokenizer)
        self.max_model_len = max_model_len
        self.max_prompt_tokens = max_prompt_tokens  # a server limit below the context, if configured
        tokens = self._shared_tokenizer.convert_ids_to_tokens(list(range(self.vocab_size)))
        self.max_chars_per_token = CHARS_PER_TOKEN_MARGIN * max(len(t or "") for t in tokens)
        self._local = threading.local()
        self._threads = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenizer",
                                           initializer=self._own_copy)
        # Start every thread now, at start-up: a thread's copy takes ~0.3 s of Python (holding the GIL), which
        # on a first request would stall the event loop after all. An executor starts a thread per task
        # submitted while the others are busy, so each of these holds one until all have started.
        started = threading.Barrier(TOKENIZER_THREADS)
        for future in [self._threads.submit(started.wait) for _ in range(TOKENIZER_THREADS)]:
            future.result()

    def _own_copy(self) -> None:
        self._local.tokenizer = copy.deepcopy(self._shared_tokenizer)

    @property
    def tokenizer(self) -> Any:
        """The tokenizer of the calling thread: its own copy on a tokenizer thread, else the shared one (the
        event loop's short decodes)."""
        return getattr(self._local, "tokenizer", self._shared_tokenizer)

    async def off_loop(self, method: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`method(*args, **kwargs)`, one of this builder's, on a tokenizer thread, awaited: the event loop
        serves other clients meanwhile (the tokenizers library lets go of the GIL while it encodes)."""
        return await asyncio.get_running_loop().run_in_executor(self._threads,
                                                                functools.partial(method, *args, **kwargs))

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _check_text_length(self, chars: int, what: str) -> None:
        """A 400 for text that cannot fit the context whatever its tokens, before spending seconds on it: no
        token covers more than `max_chars_per_token` characters."""
        if chars > self.max_model_len * self.max_chars_per_token:
            raise BadRequest(f"{what} has {chars} characters: more than the model's context of {self.max_model_len} "
                             f"tokens can hold at {self.max_chars_per_token} characters per token",
                             code="prompt_too_long")

    def token_ids(self, fields: PromptFields) -> list[int]:
        if fields.prompt_token_ids is not None:
            ids = list(fields.prompt_token_ids)
        elif fields.messages is not None:
            ids = self.render_messages(fields.messages, tools=getattr(fields, "tools", None))
        else:
            ids = self.encode(fields.prompt)
            if not ids:
                raise BadRequest("the prompt tokenizes to no tokens", code="empty_prompt")
        self.check_ids(ids, "prompt_token_ids")
        return ids

    def render_messages(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True, *,
                        tools: Sequence[Tool] | None = None) -> list[int]:
        if self.tokenizer.chat_template is None:
            raise BadRequest("this model has no chat template: send 'prompt' or 'prompt_token_ids'")
        self._check_text_length(sum(len(m.content or "") for m in messages), "messages")
        dicts, tool_schemas = chat_inputs(self.tokenizer.chat_template, messages, tools)
        encoded = self._apply_template(dicts, tool_schemas, tokenize=True, add_generation_prompt=add_generation_prompt)
        # transformers 5 returns a BatchEncoding here; older versions a plain list.
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)

    def continue_conversation(self, conversation_ids: Sequence[int], new_turns: Sequence[ChatMessage],
                              add_generation_prompt: bool = True, *, tools: Sequence[Tool] | None = None) -> list[int]:
        """`conversation_ids` (ending in the model's turn) + the end of that turn + `new_turns`, rendered by
        the chat template as they would follow an assistant message. Earlier tokens are kept as they are:
        re-rendering and re-tokenizing the model's own text can give other ids than it sampled. Tool results
        among `new_turns` answer calls in `conversation_ids`; `tools` (already in its system prompt) only
        keep a template that renders them somewhere else consistent."""
        self.check_ids(conversation_ids, "continue_from")
        earlier = [{"role": "user", "content": _EARLIER_USER}, {"role": "assistant", "content": _EARLIER_ANSWER}]
        if self.tokenizer.chat_template is None:
            raise BadRequest("this model has no chat template: build the next prompt's token ids yourself")
        turns, tool_schemas = chat_inputs(self.tokenizer.chat_template, new_turns, tools, continuation=True)
        base = self._apply_template(earlier, tool_schemas, tokenize=False)
        full = self._apply_template(earlier + turns, tool_schemas, tokenize=False,
                                    add_generation_prompt=add_generation_prompt)
        if not full.startswith(base) or _EARLIER_ANSWER not in base:
            raise BadRequest("this model's chat template does not render turn by turn: send the whole "
                             "conversation as 'messages'", code="template_not_incremental")
        turn_end = self.encode(base[base.index(_EARLIER_ANSWER) + len(_EARLIER_ANSWER):])
        # A completion that stopped on end-of-turn already holds the start of `turn_end`: do not repeat it.
        overlap = next((k for k in range(len(turn_end), 0, -1)
                        if list(conversation_ids[-k:]) == turn_end[:k]), 0)
        return list(conversation_ids) + turn_end[overlap:] + self.encode(full[len(base):])

    def _apply_template(self, messages: list[dict], tools: list[dict] | None, **kwargs):
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, **kwargs)
        # A template's raise_exception("roles must alternate ..."), or one that adds a null content to a string.
        except (TemplateError, TypeError) as exc:
            raise BadRequest(f"the model's chat template refused these messages: {exc}",
                             code="chat_template_error") from exc

    def external_completion_ids(self, completion: ExternalCompletion, field: str) -> list[int]:
        if completion.token_ids is not None:
            ids = list(completion.token_ids)
        else:
            ids = self.encode(completion.text)
            if completion.append_eos and self.tokenizer.eos_token_id is not None:
                ids.append(self.tokenizer.eos_token_id)
            if not ids:
                raise BadRequest(f"{field}: the text tokenizes to no tokens", code="empty_completion")
        self.check_ids(ids, field)
        return ids

    def encode(self, text: str) -> list[int]:
        self._check_text_length(len(text), "the text")
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_ids(self, ids: Sequence[int], field: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRequest(f"{field}: token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}",
                             code="bad_token_ids")

    def check_fits(self, prompt_len: int, completion_len: int, what: str = "max_tokens") -> None:
        if self.max_prompt_tokens is not None and prompt_len > self.max_prompt_tokens:
            raise BadRequest(f"prompt ({prompt_len} tokens) is over the server's max_prompt_tokens "
                             f"({self.max_prompt_tokens})", code="prompt_too_long")
        if prompt_len + completion_len > self.max_model_len:
            raise BadRequest(
                f"prompt ({prompt_len} tokens) + {what} ({completion_len}) exceeds the model's context "
                f"of {self.max_model_len} tokens", code="prompt_too_long")

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)
