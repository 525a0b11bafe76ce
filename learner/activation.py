"""Which adapter the shared model's forwards go through, and whose weights train: switched before every verb.

peft's `set_adapter` walks every module of the shared model, and the learner then walked every parameter to set
`requires_grad`: 0.14 s with 32 of SmolLM2's r=16 adapters resident (0.09 s of it peft's), on each verb, growing with
the experiments held. So after one full switch the next ones change only what differs: each LoRA layer's active
adapter (what peft's own switch sets on it), and `requires_grad` of the adapter that trained before and of the new
one. Adding an adapter may add LoRA layers, and peft's `delete_adapter` activates another adapter, trainable: after
either, the next switch is a full one. tests/test_learner_activation.py compares both ways on the model's state.
"""

from __future__ import annotations

from typing import Any

import torch


class AdapterSwitch:
    """The learner's switch between its experiments' adapters in one PeftModel (learner/trainer.py)."""

    def __init__(self) -> None:
        self._layers: list[Any] | None = None  # the model's LoRA layers; None: the next switch is a full one
        self._trainable: list[torch.nn.Parameter] = []

    def adapters_changed(self) -> None:
        """An adapter was added to the model or deleted from it."""
        self._layers = None

    def activate(self, model: Any, adapter: str, params: list[torch.nn.Parameter]) -> None:
        """Route `model`'s forwards through `adapter` and make its `params` (its LoRA weights, all of them) the only
        trainable ones."""
        if self._layers is None:
            from peft.tuners.tuners_utils import BaseTunerLayer

            model.set_adapter(adapter)
            for name, param in model.named_parameters():
                param.requires_grad_("lora_" in name and f".{adapter}." in name)
            self._layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
        else:
            for layer in self._layers:
                layer._active_adapter = [adapter]  # peft's BaseTunerLayer.set_adapter sets this, and flips grads
            model.base_model.active_adapter = adapter  # as peft's BaseTuner.set_adapter does after its layers'
            model.active_adapter = adapter  # and PeftModel.set_adapter before
            for param in self._trainable:
                param.requires_grad_(False)
            for param in params:
                param.requires_grad_(True)
        self._trainable = list(params)
