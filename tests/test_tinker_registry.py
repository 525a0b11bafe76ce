"""The Tinker API's saved sessions and models (grpo_server/api/tinker/registry.py), without a server: what is
saved comes back, a model whose experiment is gone is dropped, and a file it cannot read starts it empty
instead of failing the server's start. tests/test_durability.py uses the same file through a real restart."""

from __future__ import annotations

import asyncio

from grpo_server.api.tinker import schema as ts
from grpo_server.api.tinker.registry import TinkerRegistry
from grpo_server.api.tinker.state import SamplerWeights, TinkerModel


def _model(model_id: str, experiment: str) -> TinkerModel:
    return TinkerModel(model_id=model_id, experiment=experiment, owner="admin",
                       lora=ts.LoraConfig(rank=4, train_mlp=False), probe_tokens=[1, 2, 3],
                       sampler_weights={"final": SamplerWeights(3, "/run/adapters/x/v000003", saved_at=12.5)})


def _load(registry: TinkerRegistry, experiments: set[str]):
    return registry.load(TinkerModel, SamplerWeights, lambda name: name in experiments)


def test_saved_models_and_sessions_come_back(tmp_path):
    registry = TinkerRegistry(tmp_path)
    models = {m.model_id: m for m in (_model("sess-a:train:0", "tinker-a-0"), _model("sess-a:train:1", "tinker-a-1"))}
    asyncio.run(registry.save({"sess-a": "admin", "sess-b": "exp1"}, models))

    sessions, loaded = _load(TinkerRegistry(tmp_path), {"tinker-a-0"})  # tinker-a-1 was deleted meanwhile
    assert sessions == {"sess-a": "admin", "sess-b": "exp1"}
    assert list(loaded) == ["sess-a:train:0"]
    model = loaded["sess-a:train:0"]
    assert (model.experiment, model.owner, model.lora.rank, model.lora.train_mlp) == ("tinker-a-0", "admin", 4, False)
    assert model.probe_tokens == [1, 2, 3]
    assert model.sampler_weights["final"] == SamplerWeights(3, "/run/adapters/x/v000003", saved_at=12.5)


def test_no_file_or_an_unreadable_one_starts_empty(tmp_path):
    assert _load(TinkerRegistry(tmp_path), set()) == ({}, {})
    registry = TinkerRegistry(tmp_path)
    registry.path.parent.mkdir(parents=True)
    for text in ("{not json", '{"format": 99, "sessions": {}, "models": []}', '{"format": 1}'):
        registry.path.write_text(text)
        assert _load(registry, set()) == ({}, {})
        assert registry.path.read_text() == text  # left for the operator to look at, until the next change
