"""Adapter versions on disk: `run_dir/adapters/{name}/v{version:06d}/`.

Each version folder holds `adapter_config.json` and `adapter_model.safetensors` at its top level, in
the plain peft format that `PeftModel.from_pretrained(base, folder)` and vLLM's `LoRARequest` load as
is: keys like `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, no adapter name in
the keys, no embedding weights. A folder is written under a temporary name, fsynced and renamed into place
(grpo_server/protocol/durable.py), so a reader (the sampler, a restarted learner) never sees half a version,
even after a power cut: every `v*` folder is whole.

The training step count rides in the safetensors metadata (readers ignore it), so a restarted learner
continues its step numbering without an extra file in the folder; so do the feedback journal's position the
weights include (what a learner restarted before its first checkpoint resumes from) and the version's fingerprint
(grpo_server/protocol/adapter_files.py: how a sampler on another host knows its copy is this version).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from grpo_server.protocol.adapter_files import CONFIG_FILE, FINGERPRINT_KEY, WEIGHTS_FILE, read_fingerprint
from grpo_server.protocol.durable import publish_folder

STEP_KEY = "grpo_server_step"
# The feedback journal's position and the groups these weights include: a learner that dies before its first
# checkpoint resumes from the newest version, and the front end replays only the groups after it.
JOURNAL_KEY, GROUPS_KEY = "grpo_server_journal_seq", "grpo_server_groups_trained"
_VERSION_RE = re.compile(r"^v(\d{6,})$")


def adapter_root(run_dir: Path, name: str) -> Path:
    return Path(run_dir) / "adapters" / name


def version_dir(run_dir: Path, name: str, version: int) -> Path:
    return adapter_root(run_dir, name) / f"v{version:06d}"


def fingerprint(run_dir: Path, name: str, version: int) -> str | None:
    return read_fingerprint(version_dir(run_dir, name, version))


def list_versions(run_dir: Path, name: str) -> list[int]:
    """Complete versions on disk, oldest first (temporary folders of an interrupted write are skipped)."""
    root = adapter_root(run_dir, name)
    if not root.is_dir():
        return []
    versions = []
    for child in root.iterdir():
        match = _VERSION_RE.match(child.name)
        if match and (child / CONFIG_FILE).is_file() and (child / WEIGHTS_FILE).is_file():
            versions.append(int(match.group(1)))
    return sorted(versions)


def latest_version(run_dir: Path, name: str) -> int | None:
    versions = list_versions(run_dir, name)
    return versions[-1] if versions else None


def _json_default(value: Any) -> Any:
    # peft configs hold sets (target_modules) and enums; JSON wants lists and strings.
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)


class SavedVersion(NamedTuple):
    """One version folder read back: what `write_version` wrote."""

    config: dict[str, Any]  # the adapter's peft config
    tensors: dict[str, torch.Tensor]  # on the CPU
    step: int
    journal_seq: int = 0  # 0 in older folders, and in a Tinker model's (its steps are not journalled)
    groups_trained: int = 0


def write_version(folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], step: int,
                  journal_seq: int = 0, groups_trained: int = 0) -> Path:
    """Write one version atomically: a temporary sibling folder, then a rename onto `folder`."""
    folder = Path(folder)
    if folder.exists():
        raise FileExistsError(f"adapter version folder already exists: {folder}")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".tmp-{folder.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        # Clone: the live parameters are views into DeepSpeed's flat buffers, and safetensors refuses
        # tensors that share storage.
        cpu_tensors = {key: value.detach().to("cpu").clone().contiguous() for key, value in tensors.items()}
        # The fingerprint: a fresh id per write, so a copy on another host is known for this version.
        save_file(cpu_tensors, str(tmp / WEIGHTS_FILE),
                  metadata={"format": "pt", STEP_KEY: str(step), JOURNAL_KEY: str(journal_seq),
                            GROUPS_KEY: str(groups_trained), FINGERPRINT_KEY: uuid.uuid4().hex})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True, default=_json_default))
        # safetensors creates its file 0600; a sampler running as another user of the same group (a pod's
        # fsGroup) must read it. Never world-readable (grpo_server/protocol/durable.py RUN_UMASK).
        for path in (tmp, tmp / WEIGHTS_FILE, tmp / CONFIG_FILE):
            path.chmod(0o750 if path.is_dir() else 0o640)
        # Durable before anyone hears of it: the front end serves this version and a restarted learner
        # numbers on from the newest folder, so one lost to a power cut after its answer would be reused.
        publish_folder(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def read_version(folder: Path) -> SavedVersion:
    """One version folder's adapter config, tensors, step and journal position."""
    folder = Path(folder)
    config = json.loads((folder / CONFIG_FILE).read_text())
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as handle:
        metadata = handle.metadata() or {}
        for key in handle.keys():
            tensors[key] = handle.get_tensor(key)
    return SavedVersion(config, tensors, int(metadata.get(STEP_KEY, 0)), int(metadata.get(JOURNAL_KEY, 0)),
                        int(metadata.get(GROUPS_KEY, 0)))
