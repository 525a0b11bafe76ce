"""The learner's switch between adapters (learner/activation.py): after the first full switch it changes only what
differs, and leaves the shared model as peft's own `set_adapter` and a walk over every parameter would: each LoRA
layer's active adapter, the model's, and exactly the active adapter's weights trainable. Through adds, page-outs
(peft's delete_adapter activates another adapter, trainable) and removals."""

from __future__ import annotations

from grpo_server.protocol.worker_config import AlgorithmConfig
from tests.learner_helpers import LORA


def _state(model) -> tuple:
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [tuple(m.active_adapters) for m in model.modules() if isinstance(m, BaseTunerLayer)]
    return (model.active_adapter, layers, [(n, p.requires_grad) for n, p in model.named_parameters()])


def _full_switch_state(trainer, adapter: str) -> tuple:
    """What the full switch leaves: peft's set_adapter, then requires_grad by name (the switch's first way)."""
    model = trainer.model
    model.set_adapter(adapter)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name and f".{adapter}." in name)
    return _state(model)


def test_the_quick_switch_leaves_the_model_as_the_full_one(trainer):
    names = ["switch_a", "switch_b", "switch_c"]
    for name in names:
        trainer.add_experiment(name, LORA, AlgorithmConfig())
    try:
        order = ["switch_a", "switch_b", "switch_a", "switch_c", "switch_b", "switch_c"]
        quick_switches = 0
        for name in order:
            exp = trainer._get(name)
            quick = trainer._switch._layers is not None
            trainer._activate(exp.adapter, exp.params)
            got = _state(trainer.model)
            assert got == _full_switch_state(trainer, exp.adapter), name
            assert sum(flag for _, flag in got[2]) == len(exp.params) > 0
            quick_switches += quick
        assert quick_switches >= len(order) - 1  # every switch after the first was the quick one

        trainer.remove_experiment("switch_b")  # peft's delete activates another adapter, trainable
        assert trainer._switch._layers is None
        exp = trainer._get("switch_a")
        trainer._activate(exp.adapter, exp.params)
        assert _state(trainer.model) == _full_switch_state(trainer, exp.adapter)
        exp = trainer._get("switch_c")
        trainer._activate(exp.adapter, exp.params)  # quick again
        assert _state(trainer.model) == _full_switch_state(trainer, exp.adapter)
    finally:
        for name in names:
            if name in trainer.status():
                trainer.remove_experiment(name)
