"""An experiment's feedback and its training queue: rated groups (or episodes) checked, journalled and queued, and the
training task's side of the queue (batches taken, put back, trained). Part of `Experiment` (owner.py), whose fields
they read and write."""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import replace
from typing import Any, Callable

from grpo_server.api_models import FeedbackRequest, FeedbackResponse
from grpo_server.protocol.errors import Unprocessable
from grpo_server.protocol.wire import AdapterVersion, TrainMetrics
from grpo_server.runtime.advantages import rate
from grpo_server.runtime.episodes import check_rateable, trajectory_group
from grpo_server.runtime.external import external_token_ids, score_external
from grpo_server.runtime.groups import Group


class FeedbackVerbs:
    """`Experiment`'s feedback and queue (its fields are declared in owner.py)."""

    async def feedback(self, request: FeedbackRequest) -> FeedbackResponse:
        """Rewards for a sampled group, possibly with external completions added to it, or for a group of
        external completions only; or with `episode_ids`, rewards for episodes. Everything is checked before
        the group (or an episode) is taken, so a 4xx loses nothing; a failed journal write puts it back (503)."""
        name = self.name
        if request.episode_ids is not None:
            return await self._rate_episodes(request)
        if request.group_id is None:
            group = Group(group_id=self.groups.new_id(), experiment=name, completions=[],
                          prompt_token_ids=await self.prompts.off_loop(self.prompts.token_ids, request),
                          policy_version=self.serving_version,
                          temperature=self.config.sampling.temperature, max_tokens=self.config.sampling.max_tokens)
            external = request.completions
        else:
            group = self.groups.peek(name, request.group_id)
            external = request.extra_completions or []
            if len(request.rewards) != len(group.completions) + len(external):
                raise Unprocessable(
                    f"group {group.group_id} has {len(group.completions)} completions"
                    + (f" + {len(external)} extra" if external else "")
                    + f" but {len(request.rewards)} rewards were sent", code="reward_count_mismatch")
        if group.temperature == 0:
            raise Unprocessable("a group sampled at temperature 0 (greedy) has no policy gradient to train on: "
                                "sample with temperature > 0 to give feedback", code="greedy_group")
        skipped, advantages = rate(request.rewards, self.config.algorithm)
        external_ids = []
        if external:  # a bad one is a 400 here, before anything is taken
            external_ids = await self.prompts.off_loop(external_token_ids, self.prompts, group, external)
        # What this feedback adds to the tokens held: a new group's prompt, and the external completions.
        new_prompt = len(group.prompt_token_ids) if request.group_id is None else 0
        self.budget.check(name, new_prompt + sum(len(ids) for ids in external_ids))
        scored_version = None
        external_logprobs = None
        if external_ids and skipped is None:
            scored_version, added = await score_external(self, group, external_ids)
            external_logprobs = [c.logprobs for c in added]
        # Nothing below can fail for the request's sake: the group is only taken now (put back if not journalled).
        if request.group_id is not None:
            self.groups.take(name, request.group_id)  # 404/409 if it expired or was rated meanwhile
        rated = replace(group, completions=group.completions + added) if external and skipped is None else group

        def put_back() -> None:  # the group as it was (`rated` is a copy); a group made here was in no store
            if request.group_id is not None:
                self.groups.put_back(group)

        await asyncio.shield(self._accept(rated, request.rewards, advantages, skipped, put_back=put_back))
        self.counters.completions_external += len(rated.completions) - len(group.completions)
        self.rated.group(rated, request.rewards, advantages, skipped, external=request.group_id is None)
        return FeedbackResponse(group_id=group.group_id, scored_version=scored_version,
                                external_logprobs=external_logprobs, skipped=skipped)

    async def _rate_episodes(self, request: FeedbackRequest) -> FeedbackResponse:
        """A group of episodes: each episode's reward, relative to the others', trains every token the model
        sampled in it (runtime/episodes.py)."""
        episodes = self.episodes.peek(self.name, request.episode_ids)  # 404/409 before anything is taken
        check_rateable(episodes)
        skipped, advantages = rate(request.rewards, self.config.algorithm)
        group = trajectory_group(self.groups.new_id(), self.name, episodes)
        self.episodes.take(self.name, request.episode_ids)
        await asyncio.shield(self._accept(group, request.rewards, advantages, skipped,
                                          put_back=lambda: self.episodes.put_back(self.name, episodes)))
        self.counters.episodes_rated += len(episodes)
        self.rated.episodes(group, episodes, request.rewards, advantages, skipped)
        return FeedbackResponse(group_id=group.group_id, skipped=skipped)

    async def _accept(self, group: Group, rewards: list[float], advantages: list[float], skipped: str | None,
                      put_back: Callable[[], Any] = lambda: None) -> None:
        """A rated group, taken from its store: (unless skipped) journalled, durable before the 202, queued, counted.
        A failed journal write (503 journal_write_failed) calls `put_back` instead, so the retry succeeds. Callers
        shield it: a request cancelled meanwhile cannot leave the group taken but neither queued nor put back."""
        if not skipped:
            group.rewards = list(rewards)
            group.advantages = advantages
            group.sampled_step = self.version_steps.get(group.policy_version, 0)  # max_staleness counts from it
            try:  # on a thread; queued as soon as it is durable, before any later append: in journal order
                await self.journal.append_async(group, then=lambda: self.queue.append(group))
            except Exception:  # not cancelled: the write goes on, and queues the group if it succeeds
                put_back()
                raise
            self.queue_changed.set()
        self.counters.groups_received += 1
        self.counters.groups_zero_variance += skipped is not None
        self.recent_rewards.append(sum(rewards) / len(rewards))

    # --- the training task's side of the queue --------------------------------------------------------

    def resume_from(self, state: AdapterVersion) -> None:
        """Take the learner's durable position: every journalled group after it is queued (again)."""
        self.step = state.step
        self.learner_version = state.version
        self.version_steps[state.version] = state.step
        self.counters.groups_trained = state.groups_trained
        self.queue[:] = self.journal.pending(after_seq=state.journal_seq)
        self.passed_over.clear()  # whatever was passed over since that position is in the queue again
        self.queue_generation += 1
        self.gradients_pending = False  # a learner that restarted holds none
        self.queue_changed.set()

    def batch_ready(self, size: int) -> bool:
        """A batch of `size` fresh groups can be taken, and no Tinker gradients wait for their optim_step. One rule
        for both kinds of step: neither fails the other, and each waits its turn in this queue. Never while an admin
        has paused the experiment: its queue waits for the unpause."""
        return not self.paused and self.drop_stale() >= size and not self.gradients_pending

    async def queue_grew(self, timeout_s: float) -> bool:
        """Wait until a group is queued, the queue is rebuilt or pending gradients are applied; False after
        `timeout_s` without any of these."""
        self.queue_changed.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.queue_changed.wait(), timeout_s)
        return self.queue_changed.is_set()

    def drop_stale(self) -> int:
        """Drop queued groups sampled more than max_staleness optimizer steps (not versions) ago; return the rest."""
        limit = self.config.algorithm.max_staleness
        fresh = [g for g in self.queue if self.step - g.sampled_step <= limit]
        self.counters.groups_dropped_stale += len(self.queue) - len(fresh)
        if len(fresh) < len(self.queue):
            self.pass_over((g for g in self.queue if self.step - g.sampled_step > limit), "stale")
        self.queue[:] = fresh
        return len(fresh)

    def take_batch(self, size: int) -> tuple[list[Group], int]:
        """The oldest `size` queued groups, and the queue's generation they were taken from."""
        batch = self.queue[:size]
        del self.queue[:size]
        return batch, self.queue_generation

    def put_back(self, batch: list[Group], generation: int) -> bool:
        """A batch whose step failed, at the head of the queue again (True), so that no later step records a
        journal position past it: its groups were acknowledged (202) and must be trained. Not if the queue was
        rebuilt from the journal since (a learner restart): it holds them already."""
        if generation != self.queue_generation:
            return False
        self.queue[:0] = batch
        return True

    def dropped_failed(self, groups: list[Group], reason: str) -> None:
        """A batch the learner kept failing on, dropped (runtime/training.py MAX_BATCH_FAILURES): counted, and
        `reason` shown in its errors. Not put back: the next step's journal position passes it."""
        self.counters.groups_dropped_failed += len(groups)
        self.pass_over(groups, "failed")
        self.record_error(reason)

    def pass_over(self, groups, reason: str) -> None:
        """Groups leaving the queue untrained, for the next step's ledger line (TrainRequest.passed_over)."""
        self.passed_over.update((g.group_id, reason) for g in groups)

    def trained(self, groups: list[Group], metrics: TrainMetrics | None, truncated: int = 0,
                passed_over: dict[str, str] | None = None) -> None:
        """A step's answer (`metrics`), or None for a batch with nothing to train. `passed_over`: what the step's
        request carried of `self.passed_over`, in its ledger line now."""
        self.counters.completions_masked_truncated += truncated  # left out by mask_truncated; metrics None: no step
        if metrics is None:
            self.pass_over(groups, "nothing_to_train")
            return
        for group_id in passed_over or {}:
            self.passed_over.pop(group_id, None)
        self.staleness.update(self.step - g.sampled_step for g in groups)  # behind the weights this step started from
        self.step = metrics.step
        self.counters.groups_trained += len(groups)
        if metrics.checkpointed_journal_seq is not None:  # on a thread, after the appends asked before it
            self.spawn(self.journal.compact_async(metrics.checkpointed_journal_seq), "compact", finish_on_stop=True)
        self.last_metrics = {k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                             for k, v in metrics.model_dump().items()}  # JSON has no inf/NaN: shown as null
        self.probe = groups[-1]
