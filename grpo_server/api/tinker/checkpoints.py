"""The Tinker API's saved states and sampler weights (`TinkerService`'s side of them): a training state saved or loaded
(`save_weights`, `load_weights`: the learner's saved states, through the experiment's own verbs), a version pushed
for sampling (`save_for_sampler`), external weights (`save_external`: a pushed version's peft folder copied to the
server's disk), their listing, deletion and `ttl_seconds`. Part of `TinkerService` (service.py), whose tables they
read and write."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

from grpo_server.api.tinker import schema as ts
from grpo_server.api.tinker.state import SamplerWeights, TinkerModel, parse_path
from grpo_server.protocol import wire
from grpo_server.protocol.errors import BadRequest, Conflict, NotFound

PROBE_TOKENS = 64  # at most this many tokens scored by a push's check
EXTERNAL = "external_weights"  # under <run_dir>/tinker/: one folder per model, one per name within it


class CheckpointVerbs:
    """`TinkerService`'s saved states and sampler weights (its tables are declared in service.py)."""

    async def save_weights(self, model: TinkerModel, name: str | None, ttl_seconds: int | None = None) -> str:
        """A training state (weights and AdamW) as `weights/{label}`: at most tinker_max_saved_per_model of them
        per model (409 beyond: delete some), each deleted once its `ttl_seconds` have passed."""
        await self.expire_checkpoints(model)
        label = name or f"auto-{int(time.time() * 1000)}"
        experiment = self.experiment_of(model)
        saved = {s.label for s in await experiment.saved_states()}
        cap = self.orchestrator.config.tinker_max_saved_per_model
        if label not in saved and len(saved) >= cap:
            raise Conflict(f"model {model.model_id} holds {len(saved)} saved states, the server's "
                           f"tinker_max_saved_per_model: delete some first", code="too_many_checkpoints")
        await experiment.save_state(label)
        self._expire_after(model, f"weights/{label}", ttl_seconds)
        await self._saved()
        return f"tinker://{model.model_id}/weights/{label}"

    def _expire_after(self, model: TinkerModel, checkpoint_id: str, ttl_seconds: int | None) -> None:
        if ttl_seconds is not None and ttl_seconds > 0:
            model.expires[checkpoint_id] = time.time() + ttl_seconds
        else:
            model.expires.pop(checkpoint_id, None)  # saved again without one: kept

    async def expire_checkpoints(self, model: TinkerModel) -> None:
        """Delete the model's checkpoints whose ttl_seconds have passed (checked whenever it saves or lists)."""
        now = time.time()
        for checkpoint_id in [c for c, at in model.expires.items() if at <= now]:
            try:
                await self.delete_checkpoint(model, checkpoint_id)
            except NotFound:
                model.expires.pop(checkpoint_id, None)

    async def load_weights(self, owner: str, request: ts.LoadWeightsRequest) -> TinkerModel:
        """Into a new model (create-via-load, the SDK's create_training_client_from_state*) or, legacy, into
        `request.model_id`: the source model's checkpoint, with its optimizer state when asked."""
        source_id, label = parse_path(request.path, "weights")
        source = self.model(owner, source_id)
        if request.model_id is not None:
            target = self.model(owner, request.model_id)
        else:
            if request.session_id is None or request.model_seq_id is None:
                raise BadRequest("load_weights needs model_id, or session_id and model_seq_id", code="bad_request")
            target = await self.create_model(owner, request.session_id, request.model_seq_id, request.base_model,
                                             source.lora)
        await self.experiment_of(target).load_state(label, self.experiment_of(source), request.optimizer)
        return target

    async def save_for_sampler(self, model: TinkerModel, name: str | None,
                               ttl_seconds: int | None = None) -> SamplerWeights:
        """A version push, as after a native train step (runtime/training.py: written, loaded on every sampler,
        served, checked against the learner's logprobs, older versions pruned). Named, it is kept as
        `sampler_weights/{name}` (pruning keeps a named version: `Experiment.name_version`) until deleted or its
        ttl_seconds pass; unnamed, only the sampler made on it names it."""
        await self.expire_checkpoints(model)
        cap = self.orchestrator.config.tinker_max_saved_per_model
        if name is not None and name not in model.sampler_weights and len(model.sampler_weights) >= cap:
            raise Conflict(f"model {model.model_id} holds {len(model.sampler_weights)} named sampler weights, the "
                           "server's tinker_max_saved_per_model: delete some first", code="too_many_checkpoints")
        experiment = self.experiment_of(model)
        weights = SamplerWeights(*await experiment.push_for_client(probe_from(model.probe_tokens)))
        if name is not None:
            if name in model.sampler_weights:
                experiment.unname_version(model.sampler_weights[name].version)
            model.sampler_weights[name] = weights
            experiment.name_version(weights.version)
            self._expire_after(model, f"sampler_weights/{name}", ttl_seconds)
            await self._saved()
        return weights

    async def checkpoints(self, model: TinkerModel) -> list[ts.Checkpoint]:
        await self.expire_checkpoints(model)
        states = await self.experiment_of(model).saved_states()
        listed = [ts.Checkpoint(checkpoint_id=f"weights/{s.label}", checkpoint_type="training",
                                time=datetime.fromtimestamp(s.saved_at, timezone.utc),
                                tinker_path=f"tinker://{model.model_id}/weights/{s.label}") for s in states]
        listed += [ts.Checkpoint(checkpoint_id=f"sampler_weights/{name}", checkpoint_type="sampler",
                                 time=datetime.fromtimestamp(w.saved_at, timezone.utc),
                                 tinker_path=f"tinker://{model.model_id}/sampler_weights/{name}")
                   for name, w in model.sampler_weights.items()]
        listed += [ts.Checkpoint(checkpoint_id=f"{EXTERNAL}/{name}", checkpoint_type="external",
                                 time=datetime.fromtimestamp(saved_at, timezone.utc), size_bytes=size,
                                 tinker_path=f"tinker://{model.model_id}/{EXTERNAL}/{name}")
                   for name, (saved_at, size) in (await asyncio.to_thread(_folders, self.external_dir(model))).items()]
        return listed

    async def all_checkpoints(self, models: list[TinkerModel]) -> list[ts.Checkpoint]:
        """Every checkpoint of `models`, newest first (the SDK's list_user_checkpoints)."""
        listed = [c for model in models for c in await self.checkpoints(model)]
        return sorted(listed, key=lambda c: c.time, reverse=True)

    def external_dir(self, model: TinkerModel) -> Path:
        """Where `model`'s external weights are written: a folder per name, on the server's disk."""
        return self.orchestrator.config.run_dir / "tinker" / EXTERNAL / model.model_id

    async def save_external(self, model: TinkerModel, request: ts.SaveWeightsExternalRequest) -> tuple[str, int]:
        """The model's weights as a version pushed now (checked as every push is), its peft folder (what `grpo-server
        export --adapter` writes: adapter_config.json, adapter_model.safetensors) copied to `external_dir/{name}`:
        (its tinker path, its size in bytes). At most tinker_max_saved_per_model of them per model (409 beyond), as
        for saved states and named sampler weights; the same name again replaces its folder."""
        if request.age_encryption_recipients:
            raise BadRequest("age_encryption_recipients: not served here (the files are written unencrypted, on the "
                             "server's disk)", code="unsupported_parameter")
        await self.expire_checkpoints(model)
        folder = self.external_dir(model)
        held = await asyncio.to_thread(_folders, folder)
        cap = self.orchestrator.config.tinker_max_saved_per_model
        if request.path not in held and len(held) >= cap:
            raise Conflict(f"model {model.model_id} holds {len(held)} external weights, the server's "
                           "tinker_max_saved_per_model: delete some first", code="too_many_checkpoints")
        weights = await self.save_for_sampler(model, None)
        async with self.orchestrator.adapter_dir(model.experiment, weights.version) as adapter:
            size = await asyncio.to_thread(_copy_into_place, adapter, folder / request.path)
        checkpoint_id = f"{EXTERNAL}/{request.path}"
        self._expire_after(model, checkpoint_id, request.ttl_seconds)
        await self._saved()
        return f"tinker://{model.model_id}/{checkpoint_id}", size

    async def delete_checkpoint(self, model: TinkerModel, checkpoint_id: str) -> None:
        kind, _, name = checkpoint_id.partition("/")
        if kind == "weights":
            await self.experiment_of(model).delete_state(name)
            model.expires.pop(checkpoint_id, None)
            await self._saved()
        elif kind == "sampler_weights" and name in model.sampler_weights:
            weights = model.sampler_weights.pop(name)
            if model.experiment in self.orchestrator.experiments:
                self.orchestrator.get(model.experiment).unname_version(weights.version)
            model.expires.pop(checkpoint_id, None)
            await self._saved()
        elif kind == EXTERNAL and name in await asyncio.to_thread(_folders, self.external_dir(model)):
            await asyncio.to_thread(shutil.rmtree, self.external_dir(model) / name)
            model.expires.pop(checkpoint_id, None)
            await self._saved()
        else:
            raise NotFound(f"no checkpoint {checkpoint_id!r} of {model.model_id!r}", code="checkpoint_not_found")


def probe_from(tokens: list[int] | None) -> wire.VersionProbe | None:
    """A push's check for a Tinker model (runtime/verification.py): the learner and a sampler score the second
    half of a sequence it trained on, given the first half, at temperature 1."""
    if not tokens or len(tokens) < 2:
        return None
    cut = max(1, min(len(tokens) // 2, len(tokens) - PROBE_TOKENS))
    return wire.VersionProbe(prompt_token_ids=tokens[:cut], completions_token_ids=[tokens[cut:]], temperature=1.0)


def _folders(root: Path) -> dict[str, tuple[float, int]]:
    """The finished folders in `root` (a copy under way has a dot name): name -> (written at, size in bytes)."""
    if not root.is_dir():
        return {}
    return {path.name: (path.stat().st_mtime, sum(f.stat().st_size for f in path.rglob("*") if f.is_file()))
            for path in root.iterdir() if path.is_dir() and not path.name.startswith(".")}


def _copy_into_place(source: Path, target: Path) -> int:
    """`source`'s files as `target`, whole or not at all: copied under a dot name beside it, then renamed over it
    (a listing never sees half a copy). Its size in bytes."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.parent / f".{target.name}.{secrets.token_hex(4)}"
    try:
        shutil.copytree(source, partial)
        if target.exists():
            shutil.rmtree(target)
        partial.rename(target)
        os.utime(target)  # written now: copytree gave it the version folder's time, which the listing would show
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
