"""Prompts to token ids, in the front end, so token ids are the single source of truth.

The tokenizer comes from the model folder (transformers, imported lazily: the client install does not
need it). Every completion request is checked here against the vocabulary and the context length
before a sampler sees it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from grpo_server.api_models import ChatMessage, PromptFields
from grpo_server.errors import BadRequest


class PromptBuilder:
    def __init__(self, model_dir: Path, max_model_len: int):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.vocab_size = len(self.tokenizer)
        self.max_model_len = max_model_len

    def token_ids(self, fields: PromptFields) -> list[int]:
        if fields.prompt_token_ids is not None:
            ids = list(fields.prompt_token_ids)
        elif fields.messages is not None:
            ids = self.render_messages(fields.messages)
        else:
            ids = self.tokenizer.encode(fields.prompt, add_special_tokens=False)
            if not ids:
                raise BadRequest("the prompt tokenizes to no tokens", code="empty_prompt")
        self.check_ids(ids, "prompt_token_ids")
        return ids

    def render_messages(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        if self.tokenizer.chat_template is None:
            raise BadRequest("this model has no chat template: send 'prompt' or 'prompt_token_ids'")
        encoded = self.tokenizer.apply_chat_template(
            [m.model_dump() for m in messages], tokenize=True, add_generation_prompt=add_generation_prompt
        )
        # transformers 5 returns a BatchEncoding here; older versions a plain list.
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)

    def check_ids(self, ids: Sequence[int], field: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRequest(f"{field}: token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}",
                             code="bad_token_ids")

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        if prompt_len + max_tokens > self.max_model_len:
            raise BadRequest(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the model's context "
                f"of {self.max_model_len} tokens", code="prompt_too_long")

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)
