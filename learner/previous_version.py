"""The learner's logprobs under the version before the newest saved one, for the push check that asks which
version a sampler serves (grpo_server/runtime/version_distance.py): a bf16 sampler's noise hides the gap to the
pushed version, but not whether its scoring is nearer that version or the one before.

The cheapest way to score under version N-1 once N is saved: keep the LoRA weights of each saved version in
memory (a copy of the adapter's parameters, r x (d_in + d_out) floats a projection: 19.5 MB for SmolLM2-135M at
the default r = 16 on all seven projections; two are held, N's and N-1's), and for the probe copy N-1's into the
live parameters, score, and copy N's back.
No second adapter, no file read. The copies go in place (`copy_`): DeepSpeed's ZeRO keeps views of these
tensors, which swapping `.data` would cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from grpo_server.protocol.errors import Conflict
from grpo_server.protocol.wire import LogprobsRequest, ScoredVersion, ScoreVersionRequest
from learner.adapter_state import AdapterUnderTraining



@dataclass
class SavedWeights:
    version: int  # the saved version `weights` are
    weights: list[torch.Tensor]
    previous_version: int | None = None
    previous: list[torch.Tensor] | None = None


class PreviousVersionScoring:
    """A mixin of MultiAdapterTrainer: it calls `_remember_saved` at every version it starts from or saves."""

    # What it uses of its host, MultiAdapterTrainer.
    experiments: dict[str, AdapterUnderTraining]
    _saved: dict[str, SavedWeights]
    _get: Callable[[str], AdapterUnderTraining]  # NotFound if absent
    logprobs: Callable[[LogprobsRequest], list[list[float]]]

    def _remember_saved(self, name: str) -> None:
        """The experiment's weights are its saved version now: keep a copy, and the one before as the previous."""
        exp = self.experiments[name]
        before = self._saved.get(name)
        copy = [p.detach().clone() for p in exp.params]
        self._saved[name] = SavedWeights(exp.version, copy, before.version if before else None,
                                         before.weights if before else None)

    def previous_logprobs(self, request: LogprobsRequest) -> tuple[int, list[list[float]]] | None:
        """(the previous saved version, the request's logprobs under it); None when the experiment has saved only
        the version it started from. Right after a save: the weights must still be that version's."""
        exp = self._get(request.name)
        saved = self._saved.get(request.name)
        if saved is None or saved.previous is None:
            return None
        if exp.weights_version != saved.version:
            raise Conflict(f"experiment {request.name!r} has trained past v{saved.version}: its previous version is "
                           "scored only right after a save", code="weights_moved")
        self._copy_into(exp.params, saved.previous)
        try:
            return saved.previous_version, self.logprobs(request)
        finally:
            self._copy_into(exp.params, saved.weights)

    def score_version(self, request: ScoreVersionRequest) -> ScoredVersion:
        """The push check's learner side: the probe under the version just saved, and with `previous` under the one
        before. The front end asks right after the push, before the experiment's next step."""
        exp = self._get(request.name)
        if exp.weights_version != request.version:
            holds = "has trained past its last save" if exp.weights_version is None else f"holds v{exp.weights_version}"
            raise Conflict(f"experiment {request.name!r} {holds}, not v{request.version}: a version is scored only "
                           "right after its save", code="weights_moved")
        scored = ScoredVersion(version=request.version, logprobs=self.logprobs(request))
        if request.previous:
            previous = self.previous_logprobs(request)
            if previous is not None:
                scored.previous_version, scored.previous_logprobs = previous
        return scored

    def _forget_saved(self, name: str) -> None:
        self._saved.pop(name, None)

    @staticmethod
    def _copy_into(params: list[torch.nn.Parameter], weights: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for param, weight in zip(params, weights):
                param.copy_(weight)
