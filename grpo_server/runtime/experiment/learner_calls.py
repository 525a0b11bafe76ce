"""An experiment's learner calls a client makes on its weights (the Tinker API's training verbs): forward and
backward passes, optimizer steps, saved states and pushes on request. Each runs in the experiment's training turn,
as its native steps do (runtime/training.py), and what it changes is recorded here, once: the API families never
call the learner themselves. An admin's pause holds the ones that compute (sampling.py `refuse_while_paused`); saved
states are still listed, saved and deleted. Part of `Experiment` (owner.py), whose fields they read and write."""

from __future__ import annotations

from grpo_server.protocol.wire import (AdamParams, Datum, ForwardBackwardOutput, ForwardBackwardRequest,
                                       OptimStepResponse, SavedState, VersionProbe)


class LearnerVerbs:
    """`Experiment`'s learner calls (its fields are declared in owner.py)."""

    async def forward_backward(self, data: list[Datum], loss_fn: str, loss_fn_config: dict[str, float] | None,
                               forward_only: bool = False) -> ForwardBackwardOutput:
        """The loss of `data` under the newest weights, and (unless `forward_only`) its gradients, summed on the
        learner until `optim_step`: batches of rated groups wait for it meanwhile (`gradients_pending`)."""
        self.refuse_while_paused()
        request = ForwardBackwardRequest(name=self.name, data=data, loss_fn=loss_fn, loss_fn_config=loss_fn_config)
        learner = self.workers.learner
        async with self.workers.turns.training(self.name):
            verb = learner.forward if forward_only else learner.forward_backward
            out = await verb(request, timeout_s=self.server.worker_timeout_s)
            if not forward_only:  # in the turn: a batch waiting for it sees them (training.py)
                self.gradients_summed()
        return out

    async def optim_step(self, params: AdamParams) -> OptimStepResponse:
        """One AdamW step on the gradients `forward_backward` summed."""
        self.refuse_while_paused()
        async with self.workers.turns.training(self.name):
            out = await self.workers.learner.optim_step(self.name, params)
        self.optimizer_stepped(out.step)
        return out

    def gradients_summed(self) -> None:
        """A Tinker forward_backward left gradients on the learner for its optim_step: batches wait for it."""
        self.gradients_pending = True

    def optimizer_stepped(self, step: int) -> None:
        """A Tinker optim_step moved the weights to optimizer step `step` (native steps count in `trained`), and
        applied the gradients pending: the queue's batches may go on."""
        self.step = step
        self.gradients_pending = False
        self.queue_changed.set()

    async def saved_states(self) -> list[SavedState]:
        """The training states saved on the learner (`save_state`), oldest first."""
        return (await self.workers.learner.list_states(self.name)).states

    async def save_state(self, label: str) -> None:
        """The adapter and its AdamW state as `label` on the learner (written again if it exists)."""
        async with self.workers.turns.training(self.name):
            await self.workers.learner.save_state(self.name, label, with_optimizer=True)

    async def load_state(self, label: str, source: LearnerVerbs, with_optimizer: bool) -> None:
        """`source`'s saved state `label` (maybe this experiment's own) as this experiment's weights."""
        self.refuse_while_paused()
        async with self.workers.turns.training(self.name):
            await self.workers.learner.load_state(self.name, label, source=source.name, with_optimizer=with_optimizer)

    async def delete_state(self, label: str) -> None:
        await self.workers.learner.delete_state(self.name, label)

    async def push_for_client(self, probe: VersionProbe | None) -> tuple[int, str]:
        """A push a client asked for, as after a train step (runtime/training.py `push_now`): the version now
        served and its folder."""
        self.refuse_while_paused()
        version = await self.training.push_now(probe)
        return version, self.adapter_paths[version]
