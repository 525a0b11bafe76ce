"""Every int and float field of every config model has a lower and an upper bound (issue 14, item 9): a value
outside is rejected naming the field, and the API answers 422 naming it. The fields and their bounds are read
from the models themselves, so a new numeric field without a range fails here."""

from __future__ import annotations

import math
import os
import types
import typing
from typing import Any

import msgpack
import pytest
from aiohttp.test_utils import TestClient, TestServer
from pydantic import BaseModel, ValidationError

from grpo_server import config as server_config
from grpo_server.config import ExperimentConfig, ServerConfig
from grpo_server.protocol import worker_config
from grpo_server.protocol.errors import Conflict

MODULES = (server_config, worker_config)
MODELS = sorted({obj for module in MODULES for obj in vars(module).values()
                 if isinstance(obj, type) and issubclass(obj, BaseModel) and obj.__module__ in
                 {m.__name__ for m in MODULES}}, key=lambda cls: cls.__name__)
# Values for the required fields, so that a model validates with nothing else given.
REQUIRED = {"name": "x", "model_path": "model", "run_dir": "run", "port": 1}


@pytest.fixture(autouse=True)
def _no_server_env(monkeypatch):
    """ServerConfig reads GRPO_SERVER_* from the environment: none of it here."""
    for key in [k for k in os.environ if k.startswith("GRPO_SERVER_")]:
        monkeypatch.delenv(key)


def numeric_type(annotation: Any) -> type | None:
    """int or float for a field of that type (or that type | None); None for anything else (bool, Literal, ...)."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) \
        else (annotation,)
    found = [a for a in args if a in (int, float)]
    return found[0] if found else None


def bounds(field) -> dict[str, float]:
    """The field's ge / gt / le / lt, as pydantic keeps them in its metadata."""
    return {kind: getattr(item, kind) for item in field.metadata for kind in ("ge", "gt", "le", "lt")
            if getattr(item, kind, None) is not None}


NUMERIC = [(model, name, numeric_type(field.annotation), field) for model in MODELS
           for name, field in model.model_fields.items() if numeric_type(field.annotation) is not None]
IDS = [f"{model.__name__}.{name}" for model, name, _, _ in NUMERIC]


def base(model: type[BaseModel]) -> dict[str, Any]:
    return {name: REQUIRED[name] for name, field in model.model_fields.items() if field.is_required()}


def validate(model: type[BaseModel], **values: Any) -> BaseModel:
    return model(**{**base(model), **values})  # a call, not model_validate: ServerConfig is a settings class


def rejected_at(model: type[BaseModel], name: str, value: Any) -> set[str]:
    with pytest.raises(ValidationError) as info:
        validate(model, **{name: value})
    return {".".join(str(p) for p in error["loc"]) for error in info.value.errors()}


def test_the_models_are_found():
    names = {model.__name__ for model in MODELS}
    assert {"LoraConfig", "AlgorithmConfig", "SamplingConfig", "SamplerOptions", "SamplerSettings", "LearnerOptions",
            "LearnerSettings", "SamplerConfig", "LearnerConfig", "ServerConfig"} <= names
    assert len(NUMERIC) > 40


@pytest.mark.parametrize("model, name, kind, field", NUMERIC, ids=IDS)
def test_every_numeric_field_has_a_range(model, name, kind, field):
    found = bounds(field)
    assert {"ge", "gt"} & set(found), f"{model.__name__}.{name} has no lower bound (ge or gt)"
    assert {"le", "lt"} & set(found), f"{model.__name__}.{name} has no upper bound (le or lt)"
    if kind is int:  # ints go over the wire as msgpack: far inside int64
        assert -2**62 < found.get("ge", found.get("gt")) and found.get("le", found.get("lt")) < 2**62


@pytest.mark.parametrize("model, name, kind, field", NUMERIC, ids=IDS)
def test_the_default_is_in_range(model, name, kind, field):
    # pydantic does not validate defaults: do it here.
    if field.default is not None and not field.is_required():
        assert getattr(validate(model, **{name: field.default}), name) == field.default


def _step(kind: type, value: float, up: bool) -> float:
    if kind is int:
        return value + (1 if up else -1)
    return math.nextafter(value, math.inf if up else -math.inf)


@pytest.mark.parametrize("model, name, kind, field", NUMERIC, ids=IDS)
def test_out_of_range_is_rejected_naming_the_field(model, name, kind, field):
    found = bounds(field)
    low = found["ge"] if "ge" in found else found["gt"]
    high = found["le"] if "le" in found else found["lt"]
    below = _step(kind, low, up=False) if "ge" in found else low
    above = _step(kind, high, up=True) if "le" in found else high
    specials = [2**70, -2**70] + ([math.inf, -math.inf, math.nan, 1e308] if kind is float else [])
    for value in [below, above, *specials]:
        assert name in rejected_at(model, name, value), (name, value)
    # ... and the edges are in.
    lowest = low if "ge" in found else _step(kind, low, up=True)
    highest = high if "le" in found else _step(kind, high, up=False)
    for value in (lowest, highest):
        assert getattr(validate(model, **{name: value}), name) == value


@pytest.mark.parametrize("section, values", [
    ("algorithm", {"learning_rate": 2.9e307}),
    ("algorithm", {"beta": 3.4e38}),
    ("algorithm", {"weight_decay": 2**70}),
    ("algorithm", {"max_grad_norm": 2**70}),
    *[("algorithm", {name: 2**70}) for name, field in worker_config.AlgorithmConfig.model_fields.items()
      if numeric_type(field.annotation) is int],
    *[("lora", {name: 2**70}) for name, field in worker_config.LoraConfig.model_fields.items()
      if numeric_type(field.annotation) is int],
    *[("sampling", {name: 2**70}) for name, field in server_config.SamplingConfig.model_fields.items()
      if numeric_type(field.annotation) is int],
])
def test_the_issue_cases_are_rejected(section, values):
    with pytest.raises(ValidationError) as info:
        ExperimentConfig.model_validate({"name": "x", section: values})
    (name,) = values
    assert f"{section}.{name}" in {".".join(str(p) for p in e["loc"]) for e in info.value.errors()}


def test_the_largest_experiment_goes_over_the_wire():
    """Every section's numbers at their upper bounds still pack as msgpack (as they travel to the learner)."""
    sections = {"lora": worker_config.LoraConfig, "algorithm": worker_config.AlgorithmConfig,
                "sampling": server_config.SamplingConfig}
    data: dict[str, Any] = {"name": "x"}
    for section, model in sections.items():
        data[section] = {}
        for name, field in model.model_fields.items():
            kind = numeric_type(field.annotation)
            if kind is not None:
                found = bounds(field)
                data[section][name] = found["le"] if "le" in found else _step(kind, found["lt"], up=False)
    config = ExperimentConfig.model_validate(data)
    assert msgpack.unpackb(msgpack.packb(config.model_dump(mode="json"))) == config.model_dump(mode="json")


# --- through the front end's routes: the real app, its middlewares and handler, without workers -------------

class _Orchestrator:
    """Stands in for the orchestrator (whose workers this test does not start): no experiments, and a create
    that answers 409 so a config that passes validation is told apart from one that does not."""

    experiments: dict = {}

    def __init__(self) -> None:
        self.created: list[ExperimentConfig] = []

    def configs(self) -> list[ExperimentConfig]:
        return []

    async def create(self, config: ExperimentConfig, start: str = "restart"):
        self.created.append(config)
        raise Conflict("stub orchestrator: validated", code="stub")


@pytest.fixture
async def front_end():
    from grpo_server.api.app import create_app
    from grpo_server.api.app_state import ORCHESTRATOR

    app = create_app(ServerConfig(), "admin-key")
    del app.cleanup_ctx[:]  # no workers: the routes only
    app[ORCHESTRATOR] = orchestrator = _Orchestrator()
    async with TestClient(TestServer(app)) as http:
        yield http, orchestrator


@pytest.mark.parametrize("body, where", [
    ({"name": "x", "algorithm": {"learning_rate": 2.9e307}}, "algorithm.learning_rate"),
    ({"name": "x", "algorithm": {"beta": 3.4e38}}, "algorithm.beta"),
    ({"name": "x", "algorithm": {"batch_groups": 2**70}}, "algorithm.batch_groups"),
    ({"name": "x", "algorithm": {"weight_decay": 2**70}}, "algorithm.weight_decay"),
    ({"name": "x", "algorithm": {"clip_high": 11}}, "algorithm.clip_high"),
    ({"name": "x", "lora": {"r": 2**70}}, "lora.r"),
    ({"name": "x", "sampling": {"max_tokens": 2**64}}, "sampling.max_tokens"),
])
async def test_out_of_range_is_a_422_naming_the_field(front_end, body, where):
    http, orchestrator = front_end
    response = await http.post("/v1/experiments", json=body, headers={"Authorization": "Bearer admin-key"})
    error = (await response.json())["error"]
    assert response.status == 422 and error["code"] == "invalid_request", error
    assert where in error["message"], error
    assert orchestrator.created == []


async def test_in_range_passes_the_edge(front_end):
    http, orchestrator = front_end
    body = {"name": "x", "algorithm": {"learning_rate": 1.0, "beta": 100, "batch_groups": 4096}}
    response = await http.post("/v1/experiments", json=body, headers={"Authorization": "Bearer admin-key"})
    assert response.status == 409 and (await response.json())["error"]["code"] == "stub"
    assert [c.algorithm.beta for c in orchestrator.created] == [100.0]
