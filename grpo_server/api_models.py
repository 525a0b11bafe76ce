"""Public API bodies (v1). Handlers parse into these; the client library returns them.

No ML imports: the client install shares these models with the server.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class ApiModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ChatMessage(ApiModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class PromptFields(ApiModel):
    """Exactly one of: `prompt` (text, tokenized as is), `messages` (chat, the model's template with the
    generation prompt), `prompt_token_ids` (used as is; the way to send multi-turn prompts without drift)."""

    prompt: str | None = Field(None, min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    prompt_token_ids: list[int] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _exactly_one_prompt(self) -> "PromptFields":
        given = [k for k in ("prompt", "messages", "prompt_token_ids") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of 'prompt', 'messages', 'prompt_token_ids' "
                f"(got {', '.join(given) if given else 'none'})"
            )
        return self


class CompletionsRequest(PromptFields):
    n: int | None = Field(None, ge=1, le=256, description="Group size; the experiment's default if unset.")
    temperature: float | None = Field(None, ge=0, le=10)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    stop: list[str] | None = Field(None, max_length=16)
    seed: int | None = Field(None, ge=0, lt=2**63)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class CompletionOut(ApiModel):
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


class CompletionsResponse(ApiModel):
    group_id: str
    policy_version: int
    prompt_token_ids: list[int]
    completions: list[CompletionOut]


class FeedbackRequest(ApiModel):
    group_id: str = Field(min_length=1, max_length=128)
    rewards: list[float] = Field(min_length=1)

    @field_validator("rewards")
    @classmethod
    def _finite(cls, rewards: list[float]) -> list[float]:
        bad = [i for i, r in enumerate(rewards) if not math.isfinite(r)]
        if bad:
            raise ValueError(f"rewards must be finite numbers (not at index {bad[:5]})")
        return rewards


class FeedbackResponse(ApiModel):
    group_id: str
    accepted: bool = True
    skipped: str | None = Field(None, description="Why the group will not be trained on, if so.")


class ExperimentCounters(ApiModel):
    groups_sampled: int = 0
    groups_received: int = 0
    groups_trained: int = 0
    groups_dropped_stale: int = 0
    groups_zero_variance: int = 0
    groups_expired: int = 0
    completions_sampled: int = 0
    tokens_sampled: int = 0


class VerificationResult(ApiModel):
    version: int
    mean_abs_diff: float
    max_abs_diff: float
    tokens: int
    ok: bool


class ExperimentStatus(ApiModel):
    name: str
    state: Literal["active", "error"]
    policy_version: int
    learner_version: int
    step: int
    counters: ExperimentCounters
    queued_groups: int
    pending_groups: int
    recent_reward_mean: float | None
    kl: float | None
    last_metrics: dict[str, Any] | None
    last_push_at: float | None
    last_push_seconds: float | None
    last_verification: VerificationResult | None
    errors: list[str]
    config: dict[str, Any]


class ExperimentList(ApiModel):
    experiments: list[ExperimentStatus]


class Health(ApiModel):
    status: Literal["ok", "degraded"]
    workers: dict[str, str]
    model: str
