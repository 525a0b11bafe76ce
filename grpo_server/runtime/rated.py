"""An experiment's newest rated groups and episodes, as `GET /v1/experiments/{name}/rated` shows them: what the
model wrote lately and how the client scored it, for an operator (or an agent, through `grpo-server mcp`).

A window onto the rollouts, not a record of them: in memory only (a restart starts it empty), the newest
RATED_KEPT of each experiment, at most COMPLETIONS_KEPT completions of a group, each text clipped to TEXT_CHARS,
so that it stays small beside what training holds. The feedback journal keeps what training needs, and forgets it
once trained. Prompts and episodes' transcripts are kept as their last TAIL_TOKENS token ids and decoded when read:
rating a group costs no tokenizer work on the event loop.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

from grpo_server.api_models import RatedCompletion, RatedEpisode, RatedGroup
from grpo_server.protocol.wire import Completion
from grpo_server.runtime.episodes import Episode
from grpo_server.runtime.groups import Group

RATED_KEPT = 32
COMPLETIONS_KEPT = 16
TEXT_CHARS = 500
TAIL_TOKENS = 256

Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True)
class EpisodeTail:
    episode_id: str
    turns: int
    sampled_tokens: int
    tail_ids: list[int]


@dataclass(frozen=True)
class RatedEntry:
    """One rated group as kept: everything `RatedGroup` shows but the decoded tails."""

    group_id: str
    kind: Literal["sampled", "external", "episodes"]
    policy_version: int
    rewards: list[float]
    advantages: list[float] | None
    skipped: str | None
    prompt_tail_ids: list[int]
    prompt_tokens: int
    completions: list[RatedCompletion]
    completions_total: int
    episodes: list[EpisodeTail] = field(default_factory=list)
    rated_at: float = field(default_factory=time.time)

    def shown(self, decode: Decode) -> RatedGroup:
        """As the route answers it (`decode`: token ids to text; blocking, so called off the event loop)."""
        return RatedGroup(
            group_id=self.group_id, kind=self.kind, rated_at=self.rated_at, policy_version=self.policy_version,
            rewards=self.rewards, reward_mean=statistics.fmean(self.rewards) if self.rewards else 0.0,
            advantages=self.advantages, skipped=self.skipped, prompt_tail=decode(self.prompt_tail_ids),
            prompt_tokens=self.prompt_tokens, completions=self.completions, completions_total=self.completions_total,
            episodes=[RatedEpisode(episode_id=e.episode_id, turns=e.turns, sampled_tokens=e.sampled_tokens,
                                   transcript_tail=decode(e.tail_ids)) for e in self.episodes])


def _completion(completion: Completion) -> RatedCompletion:
    return RatedCompletion(text=completion.text[:TEXT_CHARS], tokens=len(completion.token_ids),
                           finish_reason=completion.finish_reason, text_clipped=len(completion.text) > TEXT_CHARS)


class RatedLog:
    """The newest rated groups of one experiment, oldest first."""

    def __init__(self, kept: int = RATED_KEPT):
        self._entries: deque[RatedEntry] = deque(maxlen=kept)

    def group(self, group: Group, rewards: list[float], advantages: list[float], skipped: str | None,
              external: bool) -> None:
        """A sampled group (with any extra completions), or a group of external completions (`external`)."""
        self._entries.append(RatedEntry(
            group_id=group.group_id, kind="external" if external else "sampled",
            policy_version=group.policy_version, rewards=list(rewards),
            advantages=None if skipped else list(advantages), skipped=skipped,
            prompt_tail_ids=group.prompt_token_ids[-TAIL_TOKENS:], prompt_tokens=len(group.prompt_token_ids),
            completions=[_completion(c) for c in group.completions[:COMPLETIONS_KEPT]],
            completions_total=len(group.completions)))

    def episodes(self, group: Group, episodes: list[Episode], rewards: list[float], advantages: list[float],
                 skipped: str | None) -> None:
        """A group of episodes (`group`: their trajectory group, runtime/episodes.py), one reward each."""
        tails = [EpisodeTail(episode_id=e.episode_id, turns=e.turns,
                             sampled_tokens=sum(sum(s.mask) for s in e.sequences),
                             tail_ids=e.sequences[-1].full_ids[-TAIL_TOKENS:] if e.sequences else [])
                 for e in episodes]
        self._entries.append(RatedEntry(
            group_id=group.group_id, kind="episodes", policy_version=group.policy_version, rewards=list(rewards),
            advantages=None if skipped else list(advantages), skipped=skipped,
            prompt_tail_ids=group.prompt_token_ids[-TAIL_TOKENS:], prompt_tokens=len(group.prompt_token_ids),
            completions=[], completions_total=0, episodes=tails))

    def newest(self, limit: int) -> list[RatedEntry]:
        """The newest `limit` entries, oldest first."""
        return list(self._entries)[-limit:] if limit > 0 else []
