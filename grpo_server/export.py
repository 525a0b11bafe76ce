"""`grpo-server export`: one adapter version of an experiment, taken from a running server, written as

- a peft adapter folder with a model card (`--adapter OUT`): the version's files as the learner wrote them
  (they load in peft and vLLM as is) and a README.md naming the base model, the LoRA config, the version,
  its training step and the mean reward of that step's batch when the server's metrics history still has it;
- a Hugging Face model folder (`--merged OUT`): the base model with the adapter merged in, loadable by
  transformers and vLLM with no peft at all: weights (safetensors), config.json, generation_config.json, the
  base's tokenizer files, and the same model card.

The command is a client of the server (it needs no access to the run directory, so it works against a
server on another host): the adapter comes through `GET /v1/experiments/{name}/adapter?version=N`, the step
from that file's safetensors metadata, the reward from `GET .../metrics`. Only the merge needs the base
weights, from a local folder.

The merge is done in float32 whatever the output dtype: W0 + (alpha/r) B A rounded once, from the learner's
float32 adapter onto the float32 base, so a float32 export computes what the server samples (the CPU sampler
and the learner run float32) to round-off. The result is then cast to `--dtype`; its default is the dtype the
base folder's config.json declares (the embedded SmolLM2 is stored as bfloat16, so its export is too: the
same size and precision as the base the user already had), float32 where the config names none. A
bfloat16/float16 export rounds each merged weight once more, which moves logprobs by ~0.01-0.1 nats; export
float32 to reproduce the server's numbers.

torch, transformers and peft are imported only inside the merge: `--adapter` works on the client install.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from grpo_server.client import Client, GrpoServerError
from grpo_server.config import EMBEDDED_MODEL_NAME
from grpo_server.protocol.adapter_files import CONFIG_FILE, WEIGHTS_FILE, weights_header

DTYPES = ("float32", "bfloat16", "float16")
STEP_KEY = "grpo_server_step"  # the learner writes the step into the safetensors metadata (learner/adapter_io.py)
# What of the base folder travels with the merged weights: the tokenizer in any of its usual file layouts, its
# chat template, and the generation defaults. Weights, config.json and the embedded model's marker do not.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "spiece.model", "vocab.txt",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")
METRICS_LIMIT = 2000  # the most train records the server returns: the reward of an older step is not found


class ExportError(Exception):
    """A failure the user can act on (unknown experiment or version, bad key, no base model here, an output
    folder in the way). The CLI prints its message and exits non-zero, without a traceback."""


@dataclass
class FetchedVersion:
    """One adapter version downloaded from the server, with what the model card says about it."""

    experiment: str
    version: int
    folder: Path  # the peft folder, extracted into a scratch directory
    adapter_config: dict[str, Any]
    step: int | None  # None: a file written before the learner recorded steps
    reward_mean: float | None  # the train record of `step`, if the metrics history still has it
    server_model: str  # what /v1/health reports as the base model (a name, not a path)
    experiment_config: dict[str, Any]


def fetch_version(client: Client, experiment: str, version: int | None, scratch: Path) -> FetchedVersion:
    """Download `version` of `experiment` (default: the version the server serves now) into `scratch`."""
    status = _call(client.status, experiment, what=f"experiment {experiment!r}")
    # Resolved here, not left to the server: the download would take the version serving when it arrives,
    # and the card must name the version that was written.
    version = status.policy_version if version is None else version
    if version < 0:
        raise ExportError(f"--version must be 0 or more, got {version}")
    archive = _call(client.download_adapter, experiment, scratch / "adapter.tar.gz", version,
                    what=f"experiment {experiment!r} version {version}")
    folder = _extract(archive, scratch / "adapter")
    header = weights_header(folder / WEIGHTS_FILE)
    raw_step = (header.get("__metadata__") or {}).get(STEP_KEY)
    step = int(raw_step) if raw_step is not None else None
    return FetchedVersion(
        experiment=experiment, version=version, folder=folder,
        adapter_config=json.loads((folder / CONFIG_FILE).read_text()), step=step,
        reward_mean=_reward_at(client, experiment, step), server_model=_call(client.health, what="health").model,
        experiment_config=status.config)


def write_adapter(fetched: FetchedVersion, out: Path) -> Path:
    """The peft folder as the learner wrote it, plus README.md (the model card)."""
    with _publishing(out) as tmp:
        for path in fetched.folder.iterdir():
            shutil.copy2(path, tmp / path.name)
        base = fetched.adapter_config.get("base_model_name_or_path") or fetched.server_model
        (tmp / "README.md").write_text(model_card(fetched, base_model=str(base), merged_dtype=None))
    return out


def write_merged(fetched: FetchedVersion, base_dir: Path, out: Path, dtype: str | None = None) -> tuple[Path, str]:
    """The base model with the adapter merged in (in float32), saved as `dtype` (default: `default_dtype`).
    Returns the folder and the dtype written."""
    dtype = dtype or default_dtype(base_dir)
    if dtype not in DTYPES:
        raise ExportError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    try:
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
    except ImportError as exc:  # the client install (`pip install grpo-server`) has no torch
        raise ExportError(f"--merged needs torch, transformers and peft ({exc}): install grpo-server[cpu] or "
                          "grpo-server[gpu], or export --adapter alone") from exc

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    try:
        model = PeftModel.from_pretrained(base, str(fetched.folder), is_trainable=False)
    except (RuntimeError, ValueError, KeyError) as exc:  # size mismatch, target modules not found, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"the adapter of {fetched.experiment!r} version {fetched.version} does not fit the base "
                          f"model {base_dir} (trained on {fetched.server_model!r}?): {first}") from exc
    merged = model.merge_and_unload()
    merged = merged.to(getattr(torch, dtype))
    merged.config.dtype = dtype  # what loaders read for dtype="auto" (vLLM, transformers)
    with _publishing(out) as tmp:
        merged.save_pretrained(str(tmp), safe_serialization=True)
        # The base's own tokenizer and generation files, byte for byte: saving a loaded tokenizer again can
        # rewrite its config (transformers' defaults of the day), and generation_config.json must be the base's
        # (save_pretrained writes one rebuilt from config.json, without the base's sampling defaults).
        for name in TOKENIZER_FILES:
            if (base_dir / name).is_file():
                shutil.copy2(base_dir / name, tmp / name)
        (tmp / "README.md").write_text(model_card(fetched, base_model=str(base_dir), merged_dtype=dtype))
    return out, dtype


def default_dtype(base_dir: Path) -> str:
    """The dtype the base folder's config.json declares (`dtype`, or `torch_dtype` before transformers 5), if
    it is one of DTYPES; float32 otherwise."""
    try:
        config = json.loads((base_dir / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    declared = config.get("dtype") or config.get("torch_dtype")
    return declared if declared in DTYPES else "float32"


def resolve_base_model(fetched: FetchedVersion, base_model: str | Path | None) -> Path:
    """The local folder of the base weights: `--base-model`, else the path the learner trained on (the
    adapter's `base_model_name_or_path`: there when the server runs on this host or a shared volume), else the
    model /v1/health names (the embedded model's cache folder, or a folder of that name here)."""
    if base_model is not None:
        folder = Path(base_model).expanduser()
        if not (folder / "config.json").is_file():
            raise ExportError(f"--base-model {base_model}: not a Hugging Face model folder (no config.json)")
        return folder.resolve()
    candidates = []
    if fetched.adapter_config.get("base_model_name_or_path"):
        candidates.append(Path(fetched.adapter_config["base_model_name_or_path"]))
    if fetched.server_model == EMBEDDED_MODEL_NAME:
        from grpo_server.workers.model_prep import embedded_model_dir

        candidates.append(embedded_model_dir())
    else:
        candidates.append(Path(fetched.server_model))
    for folder in candidates:
        if (folder / "config.json").is_file():
            return folder.resolve()
    raise ExportError(f"the server's base model ({fetched.server_model!r}) is not a folder on this machine "
                      f"(looked at {', '.join(str(c) for c in candidates)}): give its folder with --base-model PATH")


def model_card(fetched: FetchedVersion, base_model: str, merged_dtype: str | None) -> str:
    """README.md for an exported folder: what it is, what it was trained from, and how far training got."""
    lora = fetched.adapter_config
    algorithm = fetched.experiment_config.get("algorithm") or {}
    step = "unknown (no step in the adapter file)" if fetched.step is None else str(fetched.step)
    if fetched.reward_mean is not None:
        reward = f"{fetched.reward_mean:.4f} (mean reward of the batch trained at step {fetched.step})"
    else:
        reward = "not in the server's metrics history"
    what = (f"The base model with this LoRA adapter merged in (merged in float32, saved as {merged_dtype}). It loads "
            "without peft." if merged_dtype else "A peft LoRA adapter: load it onto the base model with "
            "`PeftModel.from_pretrained(base, this_folder)`, or serve it with vLLM's `LoRARequest`.")
    lines = [
        "---",
        f"base_model: {json.dumps(base_model)}",
        *([] if merged_dtype else ["library_name: peft"]),
        "tags: [grpo, lora, grpo_server]",
        "---",
        "",
        f"# {fetched.experiment}, version {fetched.version}",
        "",
        f"Trained with GRPO by grpo_server (experiment `{fetched.experiment}`). {what}",
        "",
        "| | |",
        "|---|---|",
        f"| base model | `{base_model}` (the server's: `{fetched.server_model}`) |",
        f"| adapter version | {fetched.version} |",
        f"| training step | {step} |",
        f"| reward at that step | {reward} |",
        f"| LoRA | r {lora.get('r')}, alpha {lora.get('lora_alpha')}, dropout {lora.get('lora_dropout')}, "
        f"target modules {', '.join(sorted(lora.get('target_modules') or []))} |",
        f"| algorithm | {algorithm.get('loss', '?')}, learning rate {algorithm.get('learning_rate', '?')}, "
        f"beta {algorithm.get('beta', '?')} |",
    ]
    if merged_dtype:
        lines.append(f"| dtype | {merged_dtype} |")
    return "\n".join(lines) + "\n"


def export(url: str, api_key: str, experiment: str, *, version: int | None = None, adapter_out: Path | None = None,
           merged_out: Path | None = None, base_model: str | Path | None = None, dtype: str | None = None,
           log=print) -> FetchedVersion:
    """What `grpo-server export` does: one download, then each folder asked for."""
    if adapter_out is None and merged_out is None:
        raise ExportError("nothing to write: give --adapter OUT and/or --merged OUT")
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    for out in (adapter_out, merged_out):
        if out is not None:
            _check_free(out)  # before the download and the merge: a clash is found in a second, not minutes
    with tempfile.TemporaryDirectory(prefix="grpo-export-") as scratch, Client(url, api_key) as client:
        fetched = fetch_version(client, experiment, version, Path(scratch))
        done = f"{experiment} version {fetched.version} (step {fetched.step})"
        if adapter_out is not None:
            log(f"adapter of {done} -> {write_adapter(fetched, adapter_out)}")
        if merged_out is not None:
            base_dir = resolve_base_model(fetched, base_model)
            if base_dir.name != Path(fetched.server_model).name:  # a name only: the folder may be a copy
                warn(f"the server reports its model as {fetched.server_model!r}; merging onto {base_dir}")
            folder, written = write_merged(fetched, base_dir, merged_out, dtype)
            log(f"{base_dir.name} + adapter of {done}, merged, {written} -> {folder}")
    return fetched


# --- internals ---------------------------------------------------------------------------------


def _call(method, *args: Any, what: str) -> Any:
    """A client call, its failures as ExportErrors that say what was asked and what to do."""
    try:
        return method(*args)
    except GrpoServerError as exc:
        hint = {401: " (set GRPO_SERVER_API_KEY or --api-key to the admin key or the experiment's key)",
                403: " (this key belongs to another experiment)"}.get(exc.status, "")
        raise ExportError(f"{what}: the server answered {exc.status} {exc.code}: {exc.message}{hint}") from exc
    except (OSError, aiohttp.ClientError) as exc:  # refused, reset, timed out, disconnected
        raise ExportError(f"{what}: cannot reach the server ({type(exc).__name__}: {exc})") from exc


def _reward_at(client: Client, experiment: str, step: int | None) -> float | None:
    """The mean reward of the batch trained at `step` (its `train` metrics record), or None."""
    if step is None or step < 1:  # version 0 is the untrained adapter: no step, no reward
        return None
    try:
        records = client.metrics(experiment, kind="train", limit=METRICS_LIMIT)
    # A server without the route, or one that went away: the card says the reward is not known.
    except (GrpoServerError, OSError, aiohttp.ClientError):
        return None
    rewards = [r.get("reward_mean") for r in records if r.get("step") == step]
    return float(rewards[-1]) if rewards and isinstance(rewards[-1], (int, float)) else None


def _extract(archive: Path, dest: Path) -> Path:
    """The peft folder inside the server's .tar.gz (one top folder). `filter="data"` refuses links, absolute
    paths and `..`: the archive comes over the network."""
    with tarfile.open(archive, "r:gz") as tar:
        tar.extractall(dest, filter="data")
    folders = [p.parent for p in dest.rglob(CONFIG_FILE)]
    if len(folders) != 1 or not (folders[0] / WEIGHTS_FILE).is_file():
        raise ExportError(f"the server's adapter archive holds no single peft folder ({len(folders)} configs)")
    return folders[0]


def _check_free(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} already exists and is not an empty folder: choose another, or remove it")


class _publishing:
    """Write into a hidden sibling of `out`, then rename it into place: an interrupted export (a merge can
    take minutes) never leaves a half-written model folder where a loader would take it for whole."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.tmp = self.out.parent / f".{self.out.name}.export-{os.getpid()}"

    def __enter__(self) -> Path:
        _check_free(self.out)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir()
        return self.tmp

    def __exit__(self, kind, *rest: Any) -> None:
        if kind is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        # safetensors creates its files 0600; a model folder is read by whoever serves it (as adapter_io does).
        for path in self.tmp.iterdir():
            path.chmod(0o644)
        if self.out.is_dir():
            self.out.rmdir()  # empty (checked): replaced by the finished folder
        self.tmp.rename(self.out)


def warn(message: str) -> None:
    print(f"grpo-server export: warning: {message}", file=sys.stderr)
