"""Typed configuration for the server and its experiments.

Every model is strict (`extra="forbid"`): an unknown key is an error that names the key. Nothing here
imports an ML package, so the client, the CLI and the front end can validate a config before any
worker starts.

An experiment's `algorithm` defaults by loss (protocol/worker_config.py CLIP_DEFAULTS; explicit values win, and
the resolved numbers are what the learner, the status and the registry see):

    loss      clip_low  clip_high  advantages        aggregation                      source
    grpo      0.2       0.2        (r - mean) / std  sequence mean, then batch mean   DeepSeekMath
    dr_grpo   0.2       0.2        r - mean          token sum / (seqs x max_tokens)  Dr. GRPO
    dapo      0.2       0.28       (r - mean) / std  token mean over the batch        DAPO (clip-higher)
    gspo      3e-4      4e-4       (r - mean) / std  sequence-level ratio             GSPO paper (v2) 5.1

dr_grpo's max_tokens is the experiment's `sampling.max_tokens`, a constant for its whole life.
`max_staleness` counts optimizer steps; `mask_truncated` (off by default) leaves completions cut at
max_tokens out of the loss.

Every int and float field has a lower and an upper bound (its Field's ge/gt and le/lt, in the JSON schema too;
timeouts at most a week, WEEK_S), and floats must be finite: a value outside is a ValidationError naming the
field, which the API answers with a 422 (tests/test_config_ranges.py checks that no field goes without).
"""

from __future__ import annotations

import contextlib
import ipaddress
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Iterator, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, YamlConfigSettingsSource

from grpo_server.protocol.wire import EXPERIMENT_NAME
# LoraConfig and AlgorithmConfig are the learner's too, so they live with the workers' config.
from grpo_server.protocol.worker_config import (MAX_CONTEXT, WEEK_S, AlgorithmConfig, DTypeName, LearnerOptions,
                                                LoraConfig, SamplerOptions, StrictModel, load_yaml)

EMBEDDED_MODEL_NAME = "smollm2-135m-instruct"
EMBEDDED_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # its name on the Hugging Face hub


# ----------------------------------------------------------------------------------------------
# Experiment (its LoRA and algorithm sections are the learner's too: protocol/worker_config.py)
# ----------------------------------------------------------------------------------------------


class SamplingConfig(StrictModel):
    n: int = Field(8, ge=1, le=256, description="Completions per prompt (the group size).")
    temperature: float = Field(1.0, ge=0, le=2, description="Sampling temperature (vLLM takes 0 to 2).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    max_tokens: int = Field(256, ge=1, le=1_048_576, description=(
        "Most tokens per completion (a request may ask for its own). Also dr_grpo's constant normaliser: the loss "
        "is the sum over trained tokens / (sequences x this), whatever a request, an external completion or an "
        "episode (whose sequences hold several turns, and may be longer) brings."))


# The experiment trackers (grpo_server/trackers/): each needs the `trackers` extra's libraries.
TrackerName = Literal["trackio", "wandb", "mlflow", "tensorboard"]

MIN_KEY_LENGTH = 16  # an experiment's key: 96 bits when random (secrets.token_urlsafe(12) is 16 characters)
# Off only while the registry of an earlier run is read (`keys_as_saved`): a key saved before the rule
# existed keeps its experiment reachable across a restart; every new experiment meets the rule.
_CHECK_KEY_LENGTH: ContextVar[bool] = ContextVar("check_key_length", default=True)


@contextlib.contextmanager
def keys_as_saved() -> Iterator[None]:
    token = _CHECK_KEY_LENGTH.set(False)
    try:
        yield
    finally:
        _CHECK_KEY_LENGTH.reset(token)


def _key_schema(schema: dict[str, Any]) -> None:
    for option in schema.get("anyOf", []):  # the string branch of `SecretStr | None`
        if option.get("type") == "string":
            option["minLength"] = MIN_KEY_LENGTH


# Names the API gives a meaning of its own: "admin" is the admin key's principal (api/route_table.py ADMIN).
RESERVED_NAMES = frozenset({"admin"})


class ExperimentConfig(StrictModel):
    """One experiment (task): its adapter, algorithm and sampling defaults. `{name: x}` is valid."""

    name: str = Field(pattern=EXPERIMENT_NAME, description=(
        "Experiment name, [a-z0-9_-], 1-64 chars; not a reserved name (`admin`)."))
    api_key: SecretStr | None = Field(None, json_schema_extra=_key_schema, description=(
        f"A key that grants access to this experiment only, at least {MIN_KEY_LENGTH} characters. Left out of "
        "`POST /v1/experiments`, the server generates one and returns it once, in the answer."))
    lora: LoraConfig = Field(default_factory=LoraConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    trackers: list[TrackerName] | None = Field(None, max_length=4, description=(
        "Experiment trackers that get its metrics besides its metrics log, each named once: trackio, wandb "
        "(offline unless the server config says online), mlflow, tensorboard (needs the `trackers` extra). None: "
        "the server's `trackers.default`; [] none."))

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, name: str) -> str:
        if name in RESERVED_NAMES:
            raise ValueError(f"{name!r} is reserved (the API uses it itself); choose another name")
        return name

    @field_validator("trackers")
    @classmethod
    def _each_tracker_once(cls, trackers: list[str] | None) -> list[str] | None:
        if trackers is not None and len(set(trackers)) != len(trackers):
            raise ValueError("name each tracker once")
        return trackers

    @field_validator("api_key")
    @classmethod
    def _long_enough(cls, key: SecretStr | None) -> SecretStr | None:
        if key is not None and _CHECK_KEY_LENGTH.get() and len(key.get_secret_value()) < MIN_KEY_LENGTH:
            raise ValueError(f"api_key must be at least {MIN_KEY_LENGTH} characters, so that it cannot be "
                             "guessed (leave it out and the server generates one)")
        return key

    def public_dict(self) -> dict[str, Any]:
        """The config as shown to clients: the key is never echoed."""
        data = self.model_dump(mode="json", exclude={"api_key"})
        data["has_api_key"] = self.api_key is not None
        return data


# ----------------------------------------------------------------------------------------------
# Workers: the front end hands these down; shared fields are set once in ServerConfig.
# ----------------------------------------------------------------------------------------------

class SamplerSettings(SamplerOptions):
    """Sampler options as written in the server config: the engine's (protocol/worker_config.py) and where
    the replicas run."""

    replicas: int = Field(1, ge=1, le=64, description="Sampler processes (one per GPU on a GPU host).")
    dtype: DTypeName | None = Field(None, description=(
        "The samplers' dtype, when it differs from the server's `dtype` (which the learner keeps). None: `dtype`, "
        "but with `dtype` auto a vLLM sampler on a CPU with bf16 instructions samples in bfloat16 beside the "
        "float32 learner (workers/launch.py `sampler_dtype`). The merge of a lone experiment is recomputed from "
        "float32 weights at each version, so no update is rounded away twice; the sampler/learner gap this "
        "makes is what `algorithm.rollout_correction` (auto: token_tis then) is for (docs/training/numerics.md)."))
    base_port: int = Field(0, ge=0, le=65535, description="Port of replica 0 (0 = pick free ports).")
    devices: list[str] = Field(
        default_factory=list, description="CUDA device ids per replica, e.g. ['0', '1']; empty = inherit."
    )
    urls: list[str] = Field(default_factory=list, description=(
        "Remote sampler replicas (`grpo-server serve --role frontend`), one URL with a port each, e.g. "
        "['http://sampler-0:8101']; then `replicas` and `base_port` are not used and `--role sampler --replica N` "
        "listens on the port of urls[N]. Empty: the front end starts its own replicas."))

    @field_validator("urls")
    @classmethod
    def _check_urls(cls, urls: list[str]) -> list[str]:
        return [worker_url(url, f"sampler.urls[{i}]") for i, url in enumerate(urls)]


class LearnerSettings(LearnerOptions):
    """Learner options as written in the server config: the learner's (protocol/worker_config.py) and where
    it runs."""

    port: int = Field(0, ge=0, le=65535, description="Learner port (0 = pick a free port).")
    devices: str = Field("", description=(
        "CUDA_VISIBLE_DEVICES for the learner, e.g. '0,1'; rank i takes the i-th of them. Empty = inherit."))
    url: str | None = Field(None, description=(
        "A remote learner (`grpo-server serve --role frontend`), e.g. 'http://learner:8102'; then `port` is not "
        "used and `--role learner` listens on this URL's port. None: the front end starts its own learner."))

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str | None) -> str | None:
        return None if url is None else worker_url(url, "learner.url")

    @model_validator(mode="after")
    def _check_devices_for_ranks(self) -> "LearnerSettings":
        listed = [d for d in self.devices.split(",") if d.strip()]
        if listed and len(listed) < self.ranks:
            raise ValueError(f"learner.ranks is {self.ranks} but learner.devices lists {len(listed)} device(s) "
                             f"({self.devices!r}): each rank needs its own GPU")
        return self


class TrackersSettings(StrictModel):
    """Experiment trackers (grpo_server/trackers/): where they write, and what an experiment gets by default."""

    default: list[TrackerName] | None = Field(None, max_length=4, description=(
        "Trackers of every experiment whose config names none. None: trackio, offline, where it is installed."))
    directory: Path | None = Field(None, description=(
        "Where local trackers write (trackio/, wandb/, tensorboard/, mlflow.db). None: <run_dir>/trackers."))
    project: str = Field("grpo_server", pattern=r"^[A-Za-z0-9_.-]{1,128}$", description=(
        "The trackio project, wandb project and MLflow experiment that hold every experiment's runs."))
    wandb_mode: Literal["offline", "online"] = Field("offline", description=(
        "offline: runs are written under the trackers folder (`directory`) for `wandb sync`, nothing leaves the "
        "host. The environment's WANDB_MODE=offline (or disabled) wins over online."))
    mlflow_tracking_uri: str | None = Field(None, max_length=4096, description=(
        "MLflow's tracking store. None: sqlite:///<directory>/mlflow.db."))
    buffer_records: int = Field(1000, ge=1, le=1_000_000, description=(
        "Records each tracker may hold unwritten; past that a record is dropped and counted (a slow tracker never "
        "holds up training)."))
    close_timeout_s: float = Field(30.0, gt=0, le=3600, description=(
        "How long deleting an experiment or stopping the server waits for a tracker to write what it holds."))


# ----------------------------------------------------------------------------------------------
# Server
# ----------------------------------------------------------------------------------------------


# The YAML file `load_server_config` reads. pydantic-settings builds a settings class's sources in a classmethod
# that gets no per-call argument, so the path travels in a ContextVar, set for that one construction only.
_CONFIG_FILE: ContextVar[Path | None] = ContextVar("config_file", default=None)


class _ConfigFile(YamlConfigSettingsSource):
    """pydantic-settings' YAML source, its file read as every config file here is (load_yaml): a top level that
    is not a mapping is an error naming the file, and so is a YAML syntax error (a ValueError, which
    `grpo-server serve` reports as an invalid config instead of a traceback)."""

    def _read_file(self, file_path: Any) -> dict[str, Any]:
        try:
            return load_yaml(Path(file_path))
        except yaml.YAMLError as exc:
            raise ValueError(f"{file_path}: not valid YAML: {exc}") from exc


class ServerConfig(BaseSettings):
    """The whole server: the front end reads this, and hands the workers their part.

    Where a value comes from, first found wins: init arguments (the CLI's flags), the environment
    (`GRPO_SERVER_<FIELD>`, a nested one as `GRPO_SERVER_SAMPLER__REPLICAS` or JSON in `GRPO_SERVER_SAMPLER`),
    the YAML file given to `load_server_config`, the defaults. Nested sections merge key by key across them."""

    model_config = SettingsConfigDict(env_prefix="GRPO_SERVER_", env_nested_delimiter="__", extra="forbid",
                                      validate_assignment=True, allow_inf_nan=False)

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The earlier source wins: the file comes after the environment, so a deployment's environment (docker
        # compose, a secret manager) overrides the file it ships with, as docs/guides/configuration.md says.
        path = _CONFIG_FILE.get()
        file = (_ConfigFile(settings_cls, yaml_file=path),) if path is not None else ()
        return init_settings, env_settings, dotenv_settings, file_secret_settings, *file

    model: str = Field(
        EMBEDDED_MODEL_NAME, description=f"'{EMBEDDED_MODEL_NAME}' (the embedded model) or a local HF folder."
    )
    tinker_base_model: str | None = Field(None, description=(
        "The base model's name on the Tinker API (`base_model`, get_info's `model_name`, which the SDK's "
        "get_tokenizer loads). Unset: HuggingFaceTB/SmolLM2-135M-Instruct for the embedded model, else `model`."))
    tinker_max_calls_per_key: int = Field(256, ge=1, le=65_536, description=(
        "Tinker calls one key may have running or queued at once (their futures not finished); beyond, 429 "
        "`too_many_calls` (the SDK retries). Bounds the work and memory one tenant's pipelined calls hold."))
    tinker_max_result_mib_per_key: int = Field(256, ge=1, le=2**20, description=(
        "MiB the results of one key's finished Tinker calls may hold in the front end until they are retrieved "
        "(and their retry grace passes); beyond, 429 `too_many_futures` until the client reads them."))
    tinker_max_saved_per_model: int = Field(64, ge=1, le=100_000, description=(
        "Saved training states (save_weights) one Tinker model may hold, and named sampler weights apart; beyond, "
        "409 `too_many_checkpoints` until some are deleted (or their ttl_seconds pass). Bounds its disk."))
    tinker_max_samples_per_key: int = Field(128, ge=1, le=2**20, description=(
        "Sequences one key's Tinker asample calls may have queued or being sampled at once (num_samples summed: "
        "two calls of max_n); beyond, 429 `too_many_samples` (the SDK retries). Native and OpenAI sampling is "
        "admitted by the learner's backlog instead; this keeps one key's sampling from queueing ahead of every "
        "other tenant's (the samplers serve in arrival order)."))
    tinker_max_tokens_per_call: int = Field(65_536, ge=1, le=2**24, description=(
        "Token positions one Tinker forward / forward_backward may carry, all its datums together: each "
        "position holds full-vocabulary logits in the learner while the call runs."))
    host: str = Field("127.0.0.1", description="Address the public API listens on.")
    port: int = Field(8000, ge=0, le=65535, description="Port of the public API (0 = pick one).")
    run_dir: Path = Field(Path("runs/default"), description="Adapters, configs, logs and checkpoints.")
    api_key: SecretStr | None = Field(None, min_length=MIN_KEY_LENGTH, description=(
        f"Admin key (env GRPO_SERVER_API_KEY), at least {MIN_KEY_LENGTH} characters; unset, one is generated into "
        "<run_dir>/admin_key (mode 0600), never printed."))
    # min_length: MIN_SECRET_CHARS (protocol/worker_auth.py), which the workers check too.
    worker_secret: SecretStr | None = Field(None, min_length=16, description=(
        "The secret every call to a worker must carry (env GRPO_SERVER_WORKER_SECRET, which is where the workers "
        "read it; never on a command line). Unset: the front end makes one per start for the workers it starts "
        "(<run_dir>/worker_secret, mode 0600). A split deployment (--role frontend / sampler / learner) must give "
        "every process the same one."))
    dtype: DTypeName = Field("auto", description=(
        "Model dtype. auto: bfloat16 on GPU; on CPU float32 weights, with bf16 sampling and bf16 autocast in the "
        "learner's steps where the CPU has bf16 instructions (sampler.dtype, learner.autocast). float32: exact."))
    max_model_len: int = Field(2048, ge=16, le=MAX_CONTEXT,
                               description="Context length (prompt + completion) in tokens.")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed of the workers' random generators.")
    group_ttl_s: float = Field(900.0, gt=0, le=WEEK_S, description="Groups without feedback expire after this long.")
    max_queued_batches: int = Field(
        2, ge=1, le=1024, description="Completions get 429 while this many batches of an experiment's groups are "
        "being sampled or wait for the learner: sampling more would only make stale groups (and steal the "
        "learner's CPU).")
    worker_timeout_s: float = Field(600.0, gt=0, le=WEEK_S, description="Longest wait for one worker call.")
    startup_timeout_s: float = Field(900.0, gt=0, le=WEEK_S, description="Longest wait for a worker to become healthy.")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, le=2**32, description="Largest request body accepted.")
    max_experiments: int = Field(64, ge=1, le=4096, description=(
        "Most experiments at once (each holds an adapter and its optimizer in the learner)."))
    archives_kept: int = Field(32, ge=0, le=100_000, description=(
        "Deleted experiments' archives (run_dir/archive/: their adapter versions, checkpoints, journals and "
        "metrics) kept, the newest; at each delete the older ones are removed for good, so that a server whose "
        "experiments come and go keeps a bounded disk. `resume: true` brings back a kept one only; 0 keeps none."))
    max_n: int = Field(64, ge=1, le=256, description="Largest group (n) one request may ask for.")
    max_tokens: int = Field(4096, ge=1, le=1_048_576, description="Largest max_tokens one request may ask for.")
    max_prompt_tokens: int | None = Field(None, ge=1, le=MAX_CONTEXT, description=(
        "Longest prompt in tokens (None = whatever fits the context with max_tokens)."))
    max_pending_groups: int = Field(
        1024, ge=1, le=1_000_000, description="Groups of one experiment that may await feedback at once; "
        "completions get 429 beyond it until feedback arrives or groups expire (group_ttl_s).")
    max_pending_episodes: int = Field(
        1024, ge=1, le=1_000_000, description="Episodes of one experiment that may await their reward at once; a "
        "new episode's first turn gets 429 beyond it.")
    max_held_tokens_per_experiment: int = Field(16_000_000, ge=1, le=10**12, description=(
        "Tokens one experiment may make the front end hold (pending groups and episodes, groups queued for the "
        "learner, and each request being sampled at its worst case, prompt + n x max_tokens); a request beyond "
        "it gets 429 token_budget. About 73 bytes each: the default is about 1.2 GiB (runtime/token_budget.py)."))
    max_held_tokens: int = Field(48_000_000, ge=1, le=10**12, description=(
        "The same bound for all experiments together (the default, about 3.5 GiB, fits a 24 GiB host beside "
        "the workers)."))
    max_episode_turns: int = Field(64, ge=1, le=10_000, description="Turns (completions) in one episode.")
    max_episode_tokens: int = Field(
        32768, ge=1, le=10_000_000, description="Tokens one episode may hold for training (its sequences: "
        "prompts, tool results and the model's turns).")
    episode_ttl_s: float = Field(900.0, gt=0, le=WEEK_S, description=(
        "An episode that gets no turn and no reward for this long expires (counted in episodes_expired)."))
    max_loaded_versions: int = Field(
        4, ge=2, le=256, description="Adapter versions of one experiment loaded on the samplers at once (the "
        "served one plus older ones that requests still use); a push waits for a slot.")
    schedule: Literal["auto", "overlap", "alternate", "alternate_all"] = Field(
        "auto", description="Sampling and training at the same time (overlap: the sampler and the learner have "
        "their own devices) or in turns (alternate: a train step waits for its experiment's sampler calls running "
        "and holds its new ones until it ends, for a CPU host where they share the cores; other experiments' "
        "sampling goes on beside it, so no tenant waits out another's steps; alternate_all: every experiment's "
        "sampling waits, the fastest steps but the slowest completions for tenants beside a training one). auto: "
        "alternate when the workers run on this machine and it has no NVIDIA GPU, overlap otherwise "
        "(grpo_server/workers/pool.py).")
    verify_tolerance: float = Field(
        0.05, gt=0, le=100, description="Largest mean |sampler - learner| logprob gap accepted after a push (nats)."
    )
    verify_method: Literal["auto", "tolerance", "nearest_version"] = Field("auto", description=(
        "How a push is checked. tolerance: the sampler's logprobs under the new version within verify_tolerance "
        "of the learner's. nearest_version: nearer the learner's new version than its previous one, and within "
        "a band of the noise floor the first step measures (grpo_server/runtime/version_distance.py), for "
        "numerics that differ. auto: nearest_version when sampler.dtype differs from dtype or a worker computes "
        "in a 16-bit dtype (bfloat16 on a GPU by default), tolerance when all are float32."))
    verify_idle_s: float = Field(5.0, gt=0, le=3600, description=(
        "A pushed version that no next train step checks (the run's last, or one its next batch was not sampled "
        "by) is probed on a sampler once training has been idle this long with no sampler call running."))
    auth_failure_limit: int = Field(10, ge=0, le=10_000, description=(
        "Unknown keys one client address may send within auth_failure_window_s; past that, every call that "
        "needs a key gets 429 (with Retry-After) until the oldest of them leaves the window. 0 = no limit. An "
        "IPv6 client counts by its /64."))
    auth_failure_window_s: float = Field(60.0, gt=0, le=WEEK_S, description="The window of auth_failure_limit.")
    auth_limit_exempt: list[str] = Field(default_factory=list, description=(
        "Client addresses or networks (CIDR) auth_failure_limit never slows down, e.g. a trusted monitor. "
        "Behind a reverse proxy every client has the proxy's address: exempt it only if it limits itself."))
    key_rate_limit: float = Field(200.0, ge=0, le=1_000_000, description=(
        "Requests a second one experiment key may send on average: a token bucket per key, refilled at this rate "
        "and holding key_rate_burst. A request that finds it empty gets 429 `rate_limited` with Retry-After as soon "
        "as its key is known, before its body is read or any work is done; a refused request takes no token. "
        "Other keys are not affected; the admin key is not limited. 0 = no limit."))
    key_rate_burst: int = Field(400, ge=1, le=1_000_000, description=(
        "How many requests one experiment key may send at once before key_rate_limit's average applies."))
    key_refusal_hold_s: float = Field(1.0, ge=0, le=60, description=(
        "A key refused (429, or 400 / 413 / 422) more than 10 times a second gets its further refusals after a "
        "pause: its Retry-After, at most this long (up to 128 held per key), so a client that retries at once "
        "without waiting is paced instead of costing the server a request each time. 0 = answered at once."))
    tls_certfile: Path | None = Field(None, description="PEM certificate (chain): serve HTTPS for remote clients.")
    tls_keyfile: Path | None = Field(None, description="PEM private key of tls_certfile.")
    log_format: Literal["plain", "json"] = Field("plain", description="Every process's log lines: plain text, or a "
                                                 "JSON object a line; both with experiment, version, request id.")
    trackers: TrackersSettings = Field(default_factory=TrackersSettings)
    sampler: SamplerSettings = Field(default_factory=SamplerSettings)
    learner: LearnerSettings = Field(default_factory=LearnerSettings)
    experiments: list[ExperimentConfig] = Field(
        default_factory=list, description="Experiments created at start (inline, or YAML file paths)."
    )

    @model_validator(mode="after")
    def _remote_workers_together(self) -> "ServerConfig":
        # A front end either starts all its workers or connects to all of them: mixing would leave
        # nobody to restart the remote half, or a local half on a machine meant to run none.
        if bool(self.sampler.urls) != (self.learner.url is not None):
            raise ValueError("give both sampler.urls and learner.url (remote workers, --role frontend), or neither")
        return self

    @property
    def remote_workers(self) -> bool:
        """True when the workers run elsewhere (their URLs are configured) and the front end only connects."""
        return bool(self.sampler.urls)

    @model_validator(mode="after")
    def _experiments_fit_the_samplers(self) -> "ServerConfig":
        # Each would be refused at its create, after the workers had started, and held as failed.
        for experiment in self.experiments:
            if experiment.lora.r > self.sampler.max_lora_rank:
                raise ValueError(f"experiment {experiment.name!r} has lora.r {experiment.lora.r}, over "
                                 f"sampler.max_lora_rank {self.sampler.max_lora_rank}: raise that or lower lora.r")
        return self

    @model_validator(mode="after")
    def _tls_pair(self) -> "ServerConfig":
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ValueError("give both tls_certfile and tls_keyfile, or neither")
        return self

    @field_validator("auth_limit_exempt")
    @classmethod
    def _check_networks(cls, networks: list[str]) -> list[str]:
        for network in networks:
            ipaddress.ip_network(network, strict=False)  # a ValueError names the bad one
        return networks

    @field_validator("experiments", mode="before")
    @classmethod
    def _load_experiment_files(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        return [load_yaml(Path(item)) if isinstance(item, str) else item for item in value]


def worker_url(url: str, where: str) -> str:
    """A worker's base URL, checked: http(s), a host and an explicit port (the worker listens on it)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError as exc:  # a port that is not a number, or out of range
        raise ValueError(f"{where}: {url!r} has a bad port") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{where}: {url!r} is not an http(s)://host:port URL")
    if port is None:
        raise ValueError(f"{where}: {url!r} needs an explicit port (the worker listens on it)")
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise ValueError(f"{where}: {url!r} must be a base URL without a path")
    return f"{parts.scheme}://{parts.netloc}"


def load_server_config(path: Path | None = None, **overrides: Any) -> ServerConfig:
    """Server config: explicit overrides (None = not given) over the environment over the YAML file at `path`
    over the defaults (ServerConfig.settings_customise_sources)."""
    if path is not None and not Path(path).is_file():
        # pydantic-settings skips a config file that is not there; a server started on defaults instead of
        # the config named would be worse than an error.
        raise FileNotFoundError(f"{path}: no such config file")
    token = _CONFIG_FILE.set(Path(path) if path is not None else None)
    try:
        return ServerConfig(**{key: value for key, value in overrides.items() if value is not None})
    finally:
        _CONFIG_FILE.reset(token)


def load_experiment_config(path: Path) -> ExperimentConfig:
    return ExperimentConfig.model_validate(load_yaml(path))


