"""Public API bodies (v1). Handlers parse into these; the client library returns them.

No ML imports: the client install shares these models with the server.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from grpo_server.config import ExperimentConfig
from grpo_server.protocol.wire import ToolCall, ToolFunction


class ApiModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


EPISODE_ID = r"^[A-Za-z0-9_.:-]{1,128}$"  # chosen by the client: a UUID, "task7-ep3", ...


class CalledFunction(ApiModel):
    name: str
    arguments: str  # JSON text


class MessageToolCall(ApiModel):
    """A tool call in an assistant message of the history, as OpenAI writes it."""

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(ApiModel):
    """A chat turn. An assistant turn may carry `tool_calls` (its `content` may then be null); a `tool` turn
    answers one of them by `tool_call_id`."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[MessageToolCall] | None = Field(None, min_length=1)
    tool_call_id: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _fields_of_role(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"only assistant messages carry 'tool_calls' (not {self.role})")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a 'tool' message needs 'tool_call_id', and only it has one")
        if self.content is None and self.tool_calls is None:
            raise ValueError(f"a {self.role} message needs 'content'" + (" or 'tool_calls'" if self.role ==
                                                                          "assistant" else ""))
        return self


class Tool(ApiModel):
    """A tool offered to the model, as OpenAI's `tools[]`: only functions."""

    type: Literal["function"] = "function"
    function: ToolFunction


class NamedToolChoice(ApiModel):
    type: Literal["function"] = "function"
    function: dict[Literal["name"], str]


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class PromptFields(ApiModel):
    """At most one of: `prompt` (text, tokenized as is), `messages` (chat, the model's template with the
    generation prompt), `prompt_token_ids` (used as is; the way to send multi-turn prompts without drift)."""

    prompt: str | None = Field(None, min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    prompt_token_ids: list[int] | None = Field(None, min_length=1)

    def prompt_fields_given(self) -> list[str]:
        return [k for k in ("prompt", "messages", "prompt_token_ids") if getattr(self, k) is not None]

    def require_one_prompt(self) -> None:
        given = self.prompt_fields_given()
        if len(given) != 1:
            raise ValueError(
                "give exactly one of 'prompt', 'messages', 'prompt_token_ids' "
                f"(got {', '.join(given) if given else 'none'})"
            )


class CompletionsRequest(PromptFields):
    n: int | None = Field(None, ge=1, le=256, description="Group size; the experiment's default if unset.")
    temperature: float | None = Field(None, ge=0, le=2)  # vLLM takes [0, 2], as OpenAI does
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    # Each at least one character: the sampler refuses an empty one, which must be a 422 here, before a stream starts.
    stop: list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=16)
    seed: int | None = Field(None, ge=0, lt=2**63)
    tools: list[Tool] | None = Field(None, min_length=1, max_length=128, description=(
        "Functions the model may call (with `messages`): its calls come back parsed as `tool_calls`."))
    tool_choice: ToolChoice | None = Field(None, description="none, auto (the default with tools), required, "
                                                             "or a named function")
    parallel_tool_calls: bool | None = None
    episode_id: str | None = Field(None, pattern=EPISODE_ID, description=(
        "This call is one turn of the client's episode with this id (n must be 1): the episode is rated "
        "as a whole by feedback with `episode_ids`."))

    @model_validator(mode="after")
    def _exactly_one_prompt(self) -> "CompletionsRequest":
        self.require_one_prompt()
        if self.tools is not None and self.messages is None:
            raise ValueError("'tools' need 'messages' (the chat template renders them)")
        return self

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class CompletionOut(ApiModel):
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    tool_calls: list[ToolCall] | None = None  # with tools offered: the calls parsed out of `text`
    content: str | None = None  # with tools offered: the text outside the calls
    constrained: bool = Field(False, description=(
        "Sampled under a grammar (tool_choice required or named): its logprobs are renormalised over the "
        "tokens the grammar allowed (docs/guides/agents.md \"What the constraint does to the importance ratio\")."))


class CompletionsResponse(ApiModel):
    group_id: str | None = Field(description="Rate the group with it (None for an episode's turn: rate the "
                                             "episode)")
    episode_id: str | None = None
    policy_version: int
    prompt_token_ids: list[int]
    completions: list[CompletionOut]


class ExternalCompletion(ApiModel):
    """A completion the model did not sample (a teacher's answer, a human fix): text or token ids."""

    text: str | None = Field(None, min_length=1)
    token_ids: list[int] | None = Field(None, min_length=1)
    append_eos: bool = Field(True, description="With `text`: end it with the end-of-turn token, so the "
                                               "model learns to stop there. Token ids are used as given.")

    @model_validator(mode="after")
    def _text_or_tokens(self) -> "ExternalCompletion":
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("give exactly one of 'text', 'token_ids'")
        return self


MAX_ABS_REWARD = 1e9  # larger ones overflow the group's mean and std (1e308 + 1e308 = inf)


def _check_finite(rewards: list[float]) -> list[float]:
    bad = [i for i, r in enumerate(rewards) if not (math.isfinite(r) and abs(r) <= MAX_ABS_REWARD)]
    if bad:
        raise ValueError(f"rewards must be finite numbers within +-{MAX_ABS_REWARD:g} (not at index {bad[:5]})")
    return rewards


class FeedbackRequest(PromptFields):
    """Rewards for a sampled group (`group_id`, optionally with `extra_completions` appended to it), for
    external completions of a prompt (`prompt`/`messages`/`prompt_token_ids` + `completions`, no group), or
    for a group of episodes (`episode_ids`, one reward each)."""

    group_id: str | None = Field(None, min_length=1, max_length=128)
    episode_ids: list[str] | None = Field(None, min_length=2, max_length=256, description=(
        "Episodes of one task, rated together: advantages are relative among them, so at least two."))
    rewards: list[float] = Field(min_length=1, max_length=512)
    extra_completions: list[ExternalCompletion] | None = Field(None, min_length=1, max_length=256)
    completions: list[ExternalCompletion] | None = Field(None, min_length=2, max_length=256, description=(
        "At least two: advantages are relative within the group, so a lone completion teaches nothing."))

    _check_rewards = field_validator("rewards")(_check_finite)

    @model_validator(mode="after")
    def _one_form(self) -> "FeedbackRequest":
        if self.episode_ids is not None:
            if self.group_id is not None or self.completions is not None or self.extra_completions is not None \
                    or self.prompt_fields_given():
                raise ValueError("with 'episode_ids', send only 'rewards' (one per episode)")
            if len(set(self.episode_ids)) != len(self.episode_ids):
                raise ValueError("'episode_ids' has an episode twice")
            if len(self.rewards) != len(self.episode_ids):
                raise ValueError(f"{len(self.episode_ids)} episodes but {len(self.rewards)} rewards")
        elif self.group_id is not None:
            if self.completions is not None or self.prompt_fields_given():
                raise ValueError("with 'group_id', send 'rewards' (and optionally 'extra_completions'); "
                                 "'completions' and a prompt are for feedback without a group")
        else:
            if self.completions is None:
                raise ValueError("give 'group_id', or a prompt with 'completions'")
            if self.extra_completions is not None:
                raise ValueError("'extra_completions' extends a sampled group: it needs 'group_id'")
            self.require_one_prompt()
            if len(self.rewards) != len(self.completions):
                raise ValueError(f"{len(self.completions)} completions but {len(self.rewards)} rewards")
        return self


class FeedbackResponse(ApiModel):
    group_id: str
    accepted: bool = True
    skipped: str | None = Field(None, description="Why the group will not be trained on, if so.")
    scored_version: int | None = Field(None, description=(
        "The policy version that scored the external completions (their behaviour logprobs)."))
    external_logprobs: list[list[float]] | None = Field(None, description=(
        "Per external completion, the logprob of each of its tokens under `scored_version`."))


class TokenizeRequest(PromptFields):
    """`prompt` or `messages` to token ids, exactly as completions would build them.

    With `continue_from` (the token ids of the conversation so far: a prompt plus the model's completion),
    `messages` are only the new turns, and the answer is `continue_from` + the end of the model's turn +
    the new turns, without re-rendering (and so re-tokenizing) anything earlier."""

    add_generation_prompt: bool = True
    continue_from: list[int] | None = Field(None, min_length=1)
    experiment: str | None = Field(None, pattern=r"^[a-z0-9_-]{1,64}$", description=(
        "The experiment these ids are for: an experiment's key must name its own (as completions' path does); "
        "the admin key may leave it out."))
    tools: list[Tool] | None = Field(None, min_length=1, max_length=128, description=(
        "With `messages`: the tools the prompt offers, rendered as completions would render them."))

    @model_validator(mode="after")
    def _text_or_messages(self) -> "TokenizeRequest":
        self.require_one_prompt()
        if self.prompt_token_ids is not None:
            raise ValueError("'prompt_token_ids' are already tokens: send 'prompt' or 'messages'")
        if self.continue_from is not None and self.messages is None:
            raise ValueError("'continue_from' needs 'messages' (the new turns)")
        if self.tools is not None and self.messages is None:
            raise ValueError("'tools' need 'messages' (the chat template renders them)")
        return self


class TokenizeResponse(ApiModel):
    token_ids: list[int]
    count: int
    max_model_len: int


class ExperimentCounters(ApiModel):
    groups_sampled: int = 0
    groups_received: int = 0
    groups_trained: int = 0
    groups_dropped_stale: int = Field(0, description=(
        "Groups dropped before training: sampled by weights more than algorithm.max_staleness optimizer steps "
        "(not pushed versions) behind the learner's"))
    groups_dropped_failed: int = Field(0, description=(
        "Groups dropped because the learner failed on (or refused) their batch's train step 5 times in a row "
        "(runtime/training.py MAX_BATCH_FAILURES; a learner that is unavailable counts no try); the reason is "
        "in the experiment's errors"))
    groups_zero_variance: int = 0
    groups_expired: int = 0
    completions_sampled: int = 0
    completions_external: int = 0
    tokens_sampled: int = 0
    completions_masked_truncated: int = Field(0, description=(
        "Completions left out of the loss by algorithm.mask_truncated (cut at max_tokens; for an episode, a "
        "sequence whose last turn was cut)"))
    episodes_started: int = 0
    episode_turns: int = 0
    episodes_rated: int = 0
    episodes_expired: int = 0


class VerificationResult(ApiModel):
    version: int
    mean_abs_diff: float
    max_abs_diff: float
    tokens: int
    ok: bool | None  # None: inconclusive (nearest_version: the version and the one before too close to tell)
    # trained_batch: the sampler's logprobs of completions the learner then trained on, against the
    # learner's own; probe: two stored completions scored by both (grpo_server/runtime/verification.py).
    checked_on: Literal["trained_batch", "probe"] = "probe"
    # tolerance: mean_abs_diff within verify_tolerance. nearest_version (grpo_server/runtime/version_distance.py):
    # the sampler nearer the learner's `version` than its `previous_version` (step_fraction ~1, not ~0, +- its
    # standard error), mean_abs_diff within NOISE_BAND x noise_floor; `reason` says what decided.
    method: Literal["tolerance", "nearest_version"] = "tolerance"
    previous_version: int | None = None
    previous_mean_abs_diff: float | None = None
    step_fraction: float | None = None
    step_fraction_se: float | None = None
    noise_floor: float | None = None
    reason: str | None = None


class TrackerStatus(ApiModel):
    """What became of the metrics records handed to one experiment tracker (grpo_server/trackers/)."""

    written: int = Field(description="Records the tracker wrote")
    dropped: int = Field(description="Records dropped: its buffer was full (a slow tracker) or it was closed first")
    errors: int = Field(description="Records (and opens, closes) the tracker failed on")
    pending: int = Field(description="Records in its buffer, not yet written")
    last_error: str | None = Field(None, description="The newest failure's text (its start)")


class ExperimentStatus(ApiModel):
    name: str
    state: Literal["active", "error", "failed"] = Field(description=(
        "'active'; 'error' when its last push check failed or its training stopped (`errors` says why); "
        "'failed' when the server could not restore it at start (`errors` says why; its other fields are zero "
        "until an admin restores it with POST /v1/experiments/{name}/restore, or deletes it)"))
    policy_version: int
    learner_version: int
    step: int
    counters: ExperimentCounters
    queued_groups: int
    pending_groups: int
    pending_episodes: int = 0
    recent_reward_mean: float | None
    kl: float | None
    last_metrics: dict[str, Any] | None
    last_push_at: float | None
    last_push_seconds: float | None
    last_verification: VerificationResult | None
    served_as: Literal["lora", "merged", "base"] | None = Field(None, description=(
        "How the sampler ran the latest completions: 'merged' = the adapter folded into the base weights "
        "(vLLM on CPU while this is the only experiment; faster, same function), 'lora' = through the "
        "LoRA adapter; None before any"))
    learner_memory: Literal["resident", "paged_out"] | None = Field(None, description=(
        "Where the learner holds its adapter and optimizer: 'resident' = in memory; 'paged_out' = on disk, in its "
        "checkpoint, since other experiments trained more recently (learner.resident_experiments), brought back "
        "exactly at its next step; None while the learner has not said (read every few seconds)"))
    suggested_groups_in_flight: int | None = Field(None, description=(
        "How many groups a client of this experiment had best keep in flight (completions asked for and not yet "
        "rated): batch_groups while it is the only experiment sampling, up to max_queued_batches x batch_groups "
        "while others sample too. examples/task_runner.py follows it unless given --concurrency. Always set; "
        "None only as read from a server older than the field"))
    errors: list[str]
    config: dict[str, Any]
    trackers: dict[str, TrackerStatus] = Field(default_factory=dict, description=(
        "Its experiment trackers by name (config `trackers`), each with its counts; empty with none"))
    paused: bool = Field(False, description=(
        "An admin paused it (POST /v1/experiments/{name}/pause): it samples no new group or episode turn (503 "
        "`experiment_paused`) and its training loop takes no batch, until POST .../unpause; feedback for what was "
        "sampled before is still taken and waits in its queue. A pause outlasts a server restart. The Tinker API's "
        "calls, which drive their own training, are not paused"))


class ExperimentList(ApiModel):
    experiments: list[ExperimentStatus]


class RatedCompletion(ApiModel):
    """One completion of a rated group, as `GET /v1/experiments/{name}/rated` shows it."""

    text: str = Field(description="What the model wrote (or the external completion), its start only when long")
    tokens: int = Field(description="Its token count")
    finish_reason: str = Field(description="stop, length, tool_calls, or external (the model did not sample it)")
    text_clipped: bool = Field(description="`text` is the start of a longer text")


class RatedEpisode(ApiModel):
    """One episode of a rated group of episodes."""

    episode_id: str
    turns: int = Field(description="Its turns (completions asked for with its id)")
    sampled_tokens: int = Field(description="The tokens the model sampled in it, over all its turns")
    transcript_tail: str = Field(description=(
        "The end of its last training sequence (the conversation as the model saw it, its own turns included), "
        "decoded"))


class RatedGroup(ApiModel):
    """A group the experiment's feedback rated: a sampled group (with any extra completions), a group of external
    completions, or a group of episodes."""

    group_id: str
    kind: Literal["sampled", "external", "episodes"]
    rated_at: float = Field(description="When its feedback was accepted (seconds since the epoch)")
    policy_version: int = Field(description="The version that sampled it (episodes: the oldest of their turns')")
    rewards: list[float] = Field(description="In the order of its completions (episodes: of its episodes)")
    reward_mean: float
    advantages: list[float] | None = Field(description="What each reward trains with; None when skipped")
    skipped: str | None = Field(description="Why it is not trained (zero_variance), or None")
    prompt_tail: str = Field(description="The end of its prompt as the model saw it (chat template included), decoded")
    prompt_tokens: int
    completions: list[RatedCompletion] = Field(description=(
        "Its completions in the order of `rewards`, the first few only in a large group (`completions_total` says "
        "how many); empty for episodes"))
    completions_total: int
    episodes: list[RatedEpisode] = Field(description="Its episodes in the order of `rewards`; empty otherwise")


class RatedGroups(ApiModel):
    """The answer of `GET /v1/experiments/{name}/rated`: its newest rated groups, oldest first."""

    name: str
    groups: list[RatedGroup]


class NewExperiment(ExperimentConfig):
    """`POST /v1/experiments`: an experiment config, and whether it continues an earlier one of its name."""

    resume: bool = Field(False, description=(
        "Continue the deleted experiment of this name from its newest archive (weights, optimizer, step, "
        "version numbers, unfinished feedback), or from its files on disk if they were never archived. "
        "Without it a name used before starts afresh at version 0: an earlier experiment's state is archived "
        "and unreachable."))

    def config(self) -> ExperimentConfig:
        return ExperimentConfig.model_validate({k: getattr(self, k) for k in ExperimentConfig.model_fields})


class CreatedExperiment(ExperimentStatus):
    """The answer of `POST /v1/experiments`: the experiment's status, and its key if the server made it."""

    api_key: str | None = Field(None, description=(
        "The key the server generated for this experiment, because the request gave none: shown this once "
        "and never again (it is not logged). None when the request gave its own."))


class ReplicaHealth(ApiModel):
    """One sampler replica, as the front end's balancer sees it."""

    state: str = Field(description="ready, or why it is out of rotation (starting, restarting, syncing, down, failed)")
    outstanding: int = Field(description="Requests in flight on it now")
    requests: int = Field(description="Requests routed to it since the front end started")


class Health(ApiModel):
    status: Literal["ok", "degraded"]
    workers: dict[str, str]
    model: str = Field(description="The base model: the embedded model's name, or a local folder's own name")
    replicas: dict[str, ReplicaHealth] = Field(default_factory=dict, description="Sampler replicas by name")
    event_loop_lag_p99_s: float = Field(0.0, description=(
        "99th percentile of the front end's event-loop lag over the last minute (runtime/loop_lag.py): how long "
        "ready requests waited for the loop"))
    event_loop_lag_max_s: float = Field(0.0, description="The largest event-loop lag of the last minute")
