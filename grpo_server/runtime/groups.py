"""The server-side store of sampled groups, waiting for their feedback.

A group keeps what training needs (prompt and completion token ids, sampler logprobs, the policy version
that sampled it, the sampling temperature and top_p), so clients never send tokens back. A group takes feedback
once; groups left without feedback expire after a TTL and are counted, so memory stays bounded.
"""

from __future__ import annotations

import secrets
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from grpo_server.protocol.errors import Conflict, NotFound
from grpo_server.protocol.wire import Completion


@dataclass
class Group:
    group_id: str
    experiment: str
    prompt_token_ids: list[int]
    completions: list[Completion]
    policy_version: int
    temperature: float
    max_tokens: int
    top_p: float = 1.0  # its sampler logprobs are renormalised over this nucleus (absent in older journals)
    created_at: float = field(default_factory=time.monotonic)
    rewards: list[float] | None = None
    advantages: list[float] | None = None
    journal_seq: int = 0  # its number in the feedback journal, once accepted for training
    # The learner's optimizer step count that the sampling version's weights were at (an episode group: its
    # oldest turn's version's); set when accepted, journalled. max_staleness counts from it (Experiment.drop_stale).
    sampled_step: int = 0
    # A group of episodes (runtime/episodes.py): completion i is a training sequence of episode
    # episode_of[i], with its own prompt and a loss mask over its tokens (1 = sampled by the model);
    # rewards and advantages are per episode. None for a group of completions of one prompt.
    episode_of: list[int] | None = None
    sequence_prompts: list[list[int]] | None = None
    loss_masks: list[list[int]] | None = None

    @property
    def tokens(self) -> int:
        """Token ids it holds (prompts and completions): what runtime/token_budget.py counts."""
        prompts = (len(self.prompt_token_ids) if self.sequence_prompts is None
                   else sum(len(p) for p in self.sequence_prompts))
        return prompts + sum(len(c.token_ids) for c in self.completions)

    def training_sequences(self) -> list[tuple[list[int], Completion, float, float, list[int] | None]]:
        """(prompt ids, completion, advantage, reward, loss mask) of every sequence it trains."""
        if self.episode_of is None:
            return [(self.prompt_token_ids, c, a, r, None)
                    for c, a, r in zip(self.completions, self.advantages, self.rewards)]
        return [(prompt, c, self.advantages[e], self.rewards[e], mask) for prompt, c, e, mask
                in zip(self.sequence_prompts, self.completions, self.episode_of, self.loss_masks)]


class GroupStore:
    """Pending groups per experiment, in creation order (the oldest expire first), and the tokens they hold
    (runtime/token_budget.py): every change of `_pending` goes through `_add` / `_remove`."""

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._pending: OrderedDict[str, Group] = OrderedDict()
        # Ids that already took feedback, so a repeat is 409 rather than 404; kept as long as a TTL.
        self._consumed: OrderedDict[str, float] = OrderedDict()
        self._pending_per_experiment: Counter[str] = Counter()
        self._tokens: Counter[str] = Counter()
        self._tokens_total = 0

    def new_id(self) -> str:
        return "grp_" + secrets.token_urlsafe(12)

    def add(self, group: Group) -> None:
        self._pending[group.group_id] = group
        self._pending_per_experiment[group.experiment] += 1
        self._count_tokens(group, +1)

    def _remove(self, group_id: str) -> Group:
        group = self._pending.pop(group_id)
        self._pending_per_experiment[group.experiment] -= 1
        self._count_tokens(group, -1)
        return group

    def _count_tokens(self, group: Group, sign: int) -> None:
        tokens = sign * group.tokens
        self._tokens[group.experiment] += tokens
        self._tokens_total += tokens

    def peek(self, experiment: str, group_id: str) -> Group:
        """The pending group: 404 if unknown or expired, 409 if it already took feedback."""
        group = self._pending.get(group_id)
        if group is None or group.experiment != experiment:
            if group_id in self._consumed:
                raise Conflict(f"group {group_id} already received feedback", code="duplicate_feedback")
            raise NotFound(f"group {group_id} is unknown or expired", code="group_not_found")
        return group

    def take(self, experiment: str, group_id: str) -> Group:
        """Remove and return a group for its feedback (errors as `peek`)."""
        self.peek(experiment, group_id)
        self._consumed[group_id] = time.monotonic()
        return self._remove(group_id)

    def put_back(self, group: Group) -> None:
        """Undo `take`: its feedback was not accepted after all (the journal write failed), so it is rateable
        again. Re-added at the end: it may outlive its TTL until the groups before it expire."""
        self._consumed.pop(group.group_id, None)
        self.add(group)

    def discard(self, experiment: str, group_id: str) -> bool:
        """Forget a pending group nobody will rate (not marked as rated: feedback for it is a 404); False if it
        is not pending."""
        group = self._pending.get(group_id)
        if group is None or group.experiment != experiment:
            return False
        self._remove(group_id)
        return True

    def expire(self, now: float | None = None) -> dict[str, int]:
        """Drop groups older than the TTL; return how many per experiment."""
        now = time.monotonic() if now is None else now
        expired: dict[str, int] = {}
        while self._pending:
            group = next(iter(self._pending.values()))
            if now - group.created_at < self.ttl_s:
                break
            self._remove(group.group_id)
            expired[group.experiment] = expired.get(group.experiment, 0) + 1
        while self._consumed and now - next(iter(self._consumed.values())) >= self.ttl_s:
            self._consumed.popitem(last=False)
        return expired

    def drop_experiment(self, experiment: str) -> None:
        for group_id in [g for g, grp in self._pending.items() if grp.experiment == experiment]:
            self._remove(group_id)
        self._pending_per_experiment.pop(experiment, None)
        self._tokens.pop(experiment, None)

    def pending_count(self, experiment: str) -> int:
        return self._pending_per_experiment[experiment]

    def tokens(self, experiment: str | None = None) -> int:
        """Tokens held by one experiment's pending groups, or (None) by all."""
        return self._tokens_total if experiment is None else self._tokens[experiment]
