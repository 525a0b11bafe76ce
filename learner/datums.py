"""Tinker datums -> checked, right-padded micro-batches for learner/steps.py.

A datum is one sequence: `tokens` is the model input, and every loss_fn_input has one value per position:
position i's logits score `target_tokens[i]` (Tinker's alignment: the caller has already shifted by one). So,
unlike learner/batching.py, every position is scored and the LM head runs over all of them (Tinker's answer has
a logprob per position).

Everything a request could get wrong is checked before the first forward (`check_request`), so that a 400 never
leaves half a call's gradients behind in the experiment's engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_server.protocol.errors import BadRequest
from grpo_server.protocol.loss_table import LOSSES, LossSpec
from grpo_server.protocol.wire import Datum
from learner.tinker_losses import grpo_settings

TOKEN_INPUTS = ("target_tokens",)  # integer inputs (token ids); the others are floats


def loss_spec(name: str) -> LossSpec:
    spec = LOSSES.get(name)
    if spec is None:
        raise BadRequest(f"unknown loss_fn {name!r}; the learner's losses are {sorted(LOSSES)}", code="unknown_loss")
    return spec


def resolve_config(spec: LossSpec, given: dict[str, float] | None) -> dict[str, float]:
    """The table's defaults with the request's values, each checked against the key's bounds."""
    given = given or {}
    unknown = sorted(set(given) - set(spec.config))
    if unknown:
        raise BadRequest(f"loss_fn_config keys {unknown} are not {spec.name}'s "
                         f"(it takes {sorted(spec.config) or 'none'})")
    config = spec.defaults
    for key, value in given.items():
        bounds = spec.config[key]
        inside = math.isfinite(value) and bounds.low <= value <= bounds.high
        if not inside or (bounds.integer and value != int(value)):
            raise BadRequest(f"loss_fn_config {key} = {value} is outside [{bounds.low:g}, {bounds.high:g}]"
                             + (" or not an integer" if bounds.integer else ""))
        config[key] = float(value)
    if spec.family == "grpo":
        grpo_settings(spec.name, config)  # its own checks (clip_low < 1, ...): a 400 now, not mid-call
    return config


def check_request(data: list[Datum], spec: LossSpec, vocab_size: int, max_model_len: int) -> None:
    for i, datum in enumerate(data):
        _check_datum(datum, spec, vocab_size, max_model_len, f"data[{i}]")
    for key in spec.optional:  # one meaning per call: the GRPO family's mask comes from weights or advantages
        having = sum(key in d.loss_fn_inputs for d in data)
        if 0 < having < len(data):
            raise BadRequest(f"loss_fn_inputs[{key!r}] is in {having} of {len(data)} datums: give it in all or none")


def _check_datum(datum: Datum, spec: LossSpec, vocab_size: int, max_model_len: int, where: str) -> None:
    n = len(datum.tokens)
    if n > max_model_len:
        raise BadRequest(f"{where}: {n} tokens, over max_model_len {max_model_len}")
    inputs = datum.loss_fn_inputs
    missing = [key for key in spec.inputs if key not in inputs]
    if missing:
        raise BadRequest(f"{where}: loss_fn_inputs lacks {missing} ({spec.name} needs {list(spec.inputs)})")
    unknown = sorted(set(inputs) - set(spec.inputs) - set(spec.optional))
    if unknown:
        raise BadRequest(f"{where}: loss_fn_inputs {unknown} are not {spec.name}'s (it takes "
                         f"{list(spec.inputs) + list(spec.optional)})")
    for key, values in inputs.items():
        if len(values) != n:
            raise BadRequest(f"{where}: loss_fn_inputs[{key!r}] has {len(values)} values for {n} tokens")
        if not all(math.isfinite(v) for v in values):
            raise BadRequest(f"{where}: loss_fn_inputs[{key!r}] has a value that is not finite")
    for label, ids in [("tokens", datum.tokens)] + [(f"loss_fn_inputs[{k!r}]", inputs[k]) for k in TOKEN_INPUTS]:
        bad = [t for t in ids if t != int(t) or not 0 <= t < vocab_size]
        if bad:
            raise BadRequest(f"{where}: {label} has {bad[0]!r}, not a token id in [0, {vocab_size})")
    if spec.family == "grpo":
        # The GRPO family weighs a whole sequence by one advantage: it must be the same on every trained position.
        trained = [a for a, w in zip(inputs["advantages"], inputs.get("weights", inputs["advantages"])) if w != 0]
        if trained and max(trained) != min(trained):
            raise BadRequest(f"{where}: {spec.name} takes one advantage per sequence, but its trained positions have "
                             f"{min(trained)} .. {max(trained)}")


def trained_positions(data: list[Datum], spec: LossSpec) -> int:
    """The GRPO family's token count for its whole-call normaliser (the positions learner/tinker_losses.py trains)."""
    key = "weights" if "weights" in data[0].loss_fn_inputs else "advantages"  # all or none (check_request)
    return sum(sum(1 for v in d.loss_fn_inputs[key] if v != 0) for d in data)


@dataclass
class DatumBatch:
    indices: list[int]  # where these datums sit in the request
    lengths: list[int]
    input_ids_B_T: Tensor  # right-padded tokens
    attention_mask_B_T: Tensor
    targets_B_T: Tensor  # target_tokens (0 on padding)
    valid_B_T: Tensor  # True on real positions
    inputs: dict[str, Tensor]  # the other loss_fn_inputs, float32, 0 on padding

    def to(self, device: torch.device | str) -> "DatumBatch":
        moved = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in vars(self).items() if k != "inputs"}
        return DatumBatch(**moved, inputs={k: v.to(device) for k, v in self.inputs.items()})


def make_datum_batches(data: list[Datum], micro_batch_size: int, pad_id: int = 0) -> list[DatumBatch]:
    """Longest first, at most `micro_batch_size` datums each, so each micro-batch pads to a similar length."""
    order = sorted(range(len(data)), key=lambda i: len(data[i].tokens), reverse=True)
    return [_collate([data[i] for i in order[s:s + micro_batch_size]], order[s:s + micro_batch_size], pad_id)
            for s in range(0, len(order), micro_batch_size)]


def _collate(data: list[Datum], indices: list[int], pad_id: int) -> DatumBatch:
    lengths = [len(d.tokens) for d in data]
    B, T = len(data), max(lengths)
    input_ids_B_T = torch.full((B, T), pad_id, dtype=torch.long)
    targets_B_T = torch.zeros((B, T), dtype=torch.long)
    valid_B_T = torch.zeros((B, T), dtype=torch.bool)
    keys = sorted(set(data[0].loss_fn_inputs) - set(TOKEN_INPUTS))
    inputs = {k: torch.zeros((B, T), dtype=torch.float32) for k in keys}
    for b, datum in enumerate(data):
        n = lengths[b]
        input_ids_B_T[b, :n] = torch.tensor(datum.tokens, dtype=torch.long)
        targets_B_T[b, :n] = torch.tensor([int(t) for t in datum.loss_fn_inputs["target_tokens"]], dtype=torch.long)
        valid_B_T[b, :n] = True
        for key in keys:  # every datum has the same keys (check_request)
            inputs[key][b, :n] = torch.tensor(datum.loss_fn_inputs[key], dtype=torch.float32)
    return DatumBatch(indices, lengths, input_ids_B_T, valid_B_T.long(), targets_B_T, valid_B_T, inputs)
