"""Episodes: many n=1 calls of an agent, scored as one (trajectory groups).

A client marks each call as a turn of its episode (`episode_id`); a reward for a group of episodes of the
same task (`feedback` with `episode_ids`) trains every token the model sampled in them with its episode's
advantage. Between its turns the server keeps what the next turn needs to continue without drift:

- **Prompt ids:** when a turn's `messages` repeat the previous turn's messages plus the reply it got (the
  usual agent loop), the new prompt is the previous turn's prompt + its sampled ids + only the new turns
  rendered (`PromptBuilder.continue_conversation`), never a re-rendering of what the model wrote. A
  history that does not extend the previous one (the agent rewrote it) is rendered afresh.
- **Sequences:** a turn whose prompt extends the previous turn's prompt + completion continues the same
  training sequence: the ids in between (the end of the model's turn, tool results, user turns, the next
  generation prompt) get loss mask 0, the sampled ids mask 1. Otherwise the turn starts a new sequence.
  So an episode usually trains as one sequence with a mask over the model's spans.

Pending episodes expire after `episode_ttl_s` without a turn or a reward, and are counted.
"""

from __future__ import annotations

import json
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

from grpo_server.api_models import ChatMessage
from grpo_server.protocol.errors import Conflict, NotFound, TooManyRequests, Unprocessable
from grpo_server.protocol.wire import Completion
from grpo_server.runtime.chat_render import check_tool_call_ids
from grpo_server.runtime.groups import Group


@dataclass
class EpisodeSequence:
    """One training sequence of an episode: a prompt, then every later token with its mask."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # the sampler's where mask is 1, else 0.0
    mask: list[int] = field(default_factory=list)
    constrained: bool = False  # a turn of it was sampled under a grammar (Completion.constrained)
    last_finish_reason: str | None = None  # its newest turn's ("length": cut by max_tokens)

    @property
    def full_ids(self) -> list[int]:
        return self.prompt_token_ids + self.token_ids


@dataclass
class Episode:
    episode_id: str
    experiment: str
    # Its first turn's temperature and top_p; every turn must sample at them (the learner scores each sequence
    # under one distribution).
    temperature: float | None = None
    top_p: float = 1.0
    sequences: list[EpisodeSequence] = field(default_factory=list)
    turns: int = 0
    oldest_version: int | None = None  # the oldest policy version that sampled one of its turns
    # The previous turn as the client saw it, to recognise its history in the next turn's messages.
    last_messages: list[dict[str, Any]] | None = None
    busy: bool = False  # a turn is being sampled
    _before_last_turn: tuple | None = field(default=None, repr=False)  # what `undo_last_turn` restores
    touched_at: float = field(default_factory=time.monotonic)

    @property
    def tokens(self) -> int:
        return sum(len(s.full_ids) for s in self.sequences)

    def continuation(self, messages: Sequence[ChatMessage] | None) -> tuple[list[int], list[ChatMessage]] | None:
        """(the last sequence's ids, the new turns) when `messages` repeat the previous turn's messages and
        its reply; None when there is no previous turn or the history was changed."""
        if messages is None or self.last_messages is None or not self.sequences:
            return None
        seen = len(self.last_messages)
        if len(messages) <= seen or [message_key(m) for m in messages[:seen]] != self.last_messages:
            return None
        check_tool_call_ids(messages)  # only the new turns are rendered, but their calls are in the history
        return self.sequences[-1].full_ids, list(messages[seen:])

    def tokens_with(self, prompt_ids: list[int], max_tokens: int) -> int:
        """Its tokens once a turn on `prompt_ids` with up to `max_tokens` is added."""
        last = self.sequences[-1].full_ids if self.sequences else None
        added = len(prompt_ids) - len(last) if last and prompt_ids[:len(last)] == last else len(prompt_ids)
        return self.tokens + added + max_tokens

    def check_decoding(self, temperature: float, top_p: float) -> None:
        if self.temperature is not None and (temperature, top_p) != (self.temperature, self.top_p):
            raise Unprocessable(f"episode {self.episode_id} samples at temperature {self.temperature}, top_p "
                                f"{self.top_p}: its turns keep them (the learner scores each sequence under one "
                                "distribution)", code="episode_temperature_changed")

    def add_turn(self, prompt_ids: list[int], completion: Completion, version: int,
                 messages: Sequence[ChatMessage] | None, decoding: tuple[float, float]) -> None:
        last = self.sequences[-1] if self.sequences else None
        self._before_last_turn = (len(self.sequences), len(last.token_ids) if last else 0,
                                  (last.constrained, last.last_finish_reason) if last else (False, None),
                                  self.last_messages, self.turns, self.temperature, self.top_p,
                                  self.oldest_version)
        if last is not None and prompt_ids[:len(last.full_ids)] == last.full_ids:
            between = prompt_ids[len(last.full_ids):]
            last.token_ids += between
            last.logprobs += [0.0] * len(between)
            last.mask += [0] * len(between)
        else:
            last = EpisodeSequence(prompt_token_ids=list(prompt_ids))
            self.sequences.append(last)
        last.token_ids += completion.token_ids
        last.logprobs += completion.logprobs
        last.mask += [1] * len(completion.token_ids)
        last.constrained = last.constrained or completion.constrained
        last.last_finish_reason = completion.finish_reason
        self.turns += 1
        self.temperature, self.top_p = decoding
        self.oldest_version = version if self.oldest_version is None else min(self.oldest_version, version)
        self.last_messages = None if messages is None else (
            [message_key(m) for m in messages] + [reply_key(completion)])
        self.touched_at = time.monotonic()

    @property
    def can_undo(self) -> bool:
        return self._before_last_turn is not None

    def undo_last_turn(self) -> None:
        """Forget the newest turn (its client never received it: a stream cut short), so that a retry of the
        same turn continues from the turn before."""
        (count, length, constrained, self.last_messages, self.turns, self.temperature, self.top_p,
         self.oldest_version) = self._before_last_turn
        self._before_last_turn = None  # only the newest turn can be undone
        del self.sequences[count:]
        if self.sequences:
            last = self.sequences[-1]
            del last.token_ids[length:], last.logprobs[length:], last.mask[length:]
            last.constrained, last.last_finish_reason = constrained

    def trainable(self) -> list[EpisodeSequence]:
        """Its sequences that hold at least one sampled token."""
        return [s for s in self.sequences if any(s.mask)]


def check_rateable(episodes: list[Episode]) -> None:
    """422 for episodes that cannot train together."""
    temperatures = {e.temperature for e in episodes}
    if len({(e.temperature, e.top_p) for e in episodes}) > 1:
        raise Unprocessable("these episodes were sampled at different temperatures or top_p "
                            f"{sorted({(e.temperature, e.top_p) for e in episodes})}: rate episodes sampled alike "
                            "together", code="mixed_temperatures")
    if 0 in temperatures:
        raise Unprocessable("episodes sampled at temperature 0 (greedy) have no policy gradient to train on",
                            code="greedy_group")
    if not any(e.trainable() for e in episodes):
        raise Unprocessable("these episodes hold no sampled token to train on", code="empty_episodes")


def trajectory_group(group_id: str, experiment: str, episodes: list[Episode]) -> Group:
    """A group of episodes as the training queue takes it: one completion per sequence (rewards and
    advantages are set per episode when accepted). Its policy version, for staleness, is the oldest that
    sampled any of its turns."""
    sequences = [(e, s) for e, episode in enumerate(episodes) for s in episode.trainable()]
    return Group(
        group_id=group_id, experiment=experiment, prompt_token_ids=sequences[0][1].prompt_token_ids,
        completions=[Completion(text="", token_ids=s.token_ids, logprobs=s.logprobs, constrained=s.constrained,
                                finish_reason="length" if s.last_finish_reason == "length" else "episode")
                     for _, s in sequences],
        policy_version=min(e.oldest_version for e in episodes), temperature=episodes[0].temperature,
        top_p=episodes[0].top_p, max_tokens=max(len(s.token_ids) for _, s in sequences),
        episode_of=[e for e, _ in sequences], sequence_prompts=[s.prompt_token_ids for _, s in sequences],
        loss_masks=[s.mask for _, s in sequences],
    )


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def message_key(message: ChatMessage) -> dict[str, Any]:
    """What identifies a history message across turns. Frameworks echo the model's reply back with small
    changes (content stripped, null for "", arguments re-serialised), so those are normalised away."""
    calls = [(c.function.name, _arguments(c.function.arguments)) for c in message.tool_calls or []]
    return {"role": message.role, "content": (message.content or "").strip(), "calls": calls,
            "tool_call_id": message.tool_call_id}


def reply_key(completion: Completion) -> dict[str, Any]:
    """`message_key` of the assistant message the client got for `completion`."""
    content = completion.content if completion.tool_calls is not None else completion.text
    calls = [(c.name, _arguments(c.arguments)) for c in completion.tool_calls or []]
    return {"role": "assistant", "content": (content or "").strip(), "calls": calls, "tool_call_id": None}


class EpisodeStore:
    """Pending episodes of every experiment, and the tokens they hold (runtime/token_budget.py): an episode's
    count is taken again whenever a turn ends or is undone (`done`)."""

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._pending: dict[tuple[str, str], Episode] = {}
        self._pending_per_experiment: Counter[str] = Counter()
        self._rated: OrderedDict[tuple[str, str], float] = OrderedDict()  # for 409 rather than 404, a TTL long
        self._counted: dict[tuple[str, str], int] = {}  # tokens of each pending episode, as last counted
        self._tokens: Counter[str] = Counter()
        self._tokens_total = 0

    def pending_count(self, experiment: str) -> int:
        return self._pending_per_experiment[experiment]

    def started(self, experiment: str, episode_id: str | None) -> bool:
        """Whether `episode_id` is a pending episode with a turn already (its next turn is no new work)."""
        episode = self._pending.get((experiment, episode_id)) if episode_id is not None else None
        return episode is not None and episode.turns > 0

    def tokens(self, experiment: str | None = None) -> int:
        """Tokens held by one experiment's pending episodes, or (None) by all."""
        return self._tokens_total if experiment is None else self._tokens[experiment]

    def _count(self, key: tuple[str, str], tokens: int) -> None:
        change = tokens - self._counted.pop(key, 0)
        if tokens:
            self._counted[key] = tokens
        self._tokens[key[0]] += change
        self._tokens_total += change

    def _forget(self, key: tuple[str, str]) -> None:
        del self._pending[key]
        self._pending_per_experiment[key[0]] -= 1
        self._count(key, 0)

    def open(self, experiment: str, episode_id: str, max_pending: int, max_turns: int) -> Episode:
        """The episode for a new turn, created on its first; marked busy (call `done` when the turn ends)."""
        key = (experiment, episode_id)
        if key in self._rated:
            raise Conflict(f"episode {episode_id} already received its reward: start a new episode id",
                           code="episode_rated")
        episode = self._pending.get(key)
        if episode is None:
            if self.pending_count(experiment) >= max_pending:
                raise TooManyRequests(f"{max_pending} episodes of {experiment!r} await their reward "
                                      "(max_pending_episodes); rate them or let them expire",
                                      code="too_many_pending_episodes", retry_after=5.0)
            episode = self._pending[key] = Episode(episode_id=episode_id, experiment=experiment)
            self._pending_per_experiment[experiment] += 1
        if episode.busy:
            raise Conflict(f"episode {episode_id} has a turn being sampled: an episode's turns come one after "
                           "the other", code="episode_busy")
        if episode.turns >= max_turns:
            raise Unprocessable(f"episode {episode_id} has {episode.turns} turns (max_episode_turns)",
                                code="episode_too_long")
        episode.busy = True
        return episode

    def done(self, episode: Episode) -> None:
        """The turn ended; an episode left without any turn (its first failed) is forgotten."""
        episode.busy = False
        episode.touched_at = time.monotonic()
        key = (episode.experiment, episode.episode_id)
        if episode.turns == 0 and key in self._pending:
            self._forget(key)
        elif key in self._pending:
            self._count(key, episode.tokens)

    def undo_turn(self, experiment: str, episode_id: str) -> None:
        """Forget an episode's newest turn (`Episode.undo_last_turn`); an episode left with no turn goes."""
        episode = self._pending.get((experiment, episode_id))
        if episode is not None and not episode.busy and episode.can_undo:
            episode.undo_last_turn()
            self.done(episode)

    def peek(self, experiment: str, episode_ids: Sequence[str]) -> list[Episode]:
        """The pending episodes, all of them rateable now, else the first problem as 404/409."""
        episodes = []
        for episode_id in episode_ids:
            key = (experiment, episode_id)
            episode = self._pending.get(key)
            if episode is None:
                if key in self._rated:
                    raise Conflict(f"episode {episode_id} already received its reward", code="duplicate_feedback")
                raise NotFound(f"episode {episode_id} is unknown or expired", code="episode_not_found")
            if episode.busy:
                raise Conflict(f"episode {episode_id} has a turn being sampled: rate it once its last turn "
                               "answered", code="episode_busy")
            episodes.append(episode)
        return episodes

    def take(self, experiment: str, episode_ids: Sequence[str]) -> list[Episode]:
        """Remove and return the episodes for their reward (errors as `peek`; none is taken on an error)."""
        episodes = self.peek(experiment, episode_ids)
        now = time.monotonic()
        for episode in episodes:
            key = (experiment, episode.episode_id)
            self._forget(key)
            self._rated[key] = now
        return episodes

    def put_back(self, experiment: str, episodes: list[Episode]) -> None:
        """Undo `take`: their reward was not accepted after all (the journal write failed); rateable again."""
        for episode in episodes:
            key = (experiment, episode.episode_id)
            self._rated.pop(key, None)
            episode.touched_at = time.monotonic()  # a full TTL for the client's retry
            self._pending[key] = episode
            self._pending_per_experiment[experiment] += 1
            self._count(key, episode.tokens)

    def expire(self, now: float | None = None) -> dict[str, int]:
        """Drop episodes idle for longer than the TTL (not while a turn runs); return how many per experiment."""
        now = time.monotonic() if now is None else now
        expired: dict[str, int] = {}
        for key, episode in list(self._pending.items()):
            if episode.busy or now - episode.touched_at < self.ttl_s:
                continue
            self._forget(key)
            expired[key[0]] = expired.get(key[0], 0) + 1
        while self._rated and now - next(iter(self._rated.values())) >= self.ttl_s:
            self._rated.popitem(last=False)
        return expired

    def drop_experiment(self, experiment: str) -> None:
        for key in [k for k in self._pending if k[0] == experiment]:
            self._forget(key)
        for key in [k for k in self._rated if k[0] == experiment]:
            del self._rated[key]
