"""Where this replica loads an adapter version from: the learner's folder where this host sees it (a shared
run directory: nothing is copied), else its own copy, fetched over the learner's HTTP into
`run_dir/adapter-copies/sampler-<replica>/<name>/v<version>/` (grpo_server/protocol/adapter_files.py).

A copy lives as long as the version is loaded: vLLM reads the folder again when the LoRA falls out of its
cache, and merged serving reads it at each merge. It is deleted when the version is unloaded, and the whole
folder is emptied when the replica starts (the front end loads the live versions into a (re)started
sampler, through this same route). The front end's unloads are best effort (a timeout is not retried), so
each load also sweeps away copies of versions the engine does not hold (`sweep`): the copies never outgrow
what is loaded. Each replica has its own folder: replicas on one host unload at different times.

Copies come from one place only: the learner this replica was started with (`SamplerConfig.learner_url`,
set by the front end). A `load_adapter` naming another `source_url` is refused (400): the request's URL is
checked, never followed, so no request can make a sampler fetch from elsewhere (or send the workers' secret,
which every fetch carries, to another host).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import AsyncIterator, Iterable

import aiohttp

from grpo_server.protocol.adapter_files import fetch_version, holds
from grpo_server.protocol.errors import BadRequest
from grpo_server.protocol.wire import AdapterRef, LoadAdapterRequest
from grpo_server.protocol.worker_auth import auth_headers

log = logging.getLogger(__name__)

_COPY_RE = re.compile(r"^v(\d{6,})(?:\.([0-9a-f]+))?$")  # v<version>[.<life>]

FETCH_TIMEOUT_S = 600.0  # a whole version; a stalled transfer fails sooner (adapter_files.READ_TIMEOUT_S)


class AdapterCopies:
    def __init__(self, run_dir: Path, replica: int, learner_url: str | None, secret: str):
        """`learner_url`: the only source of copies (None: none, every version must be readable here);
        `secret`: the workers' secret, which the learner asks of every caller."""
        self.root = Path(run_dir) / "adapter-copies" / f"sampler-{replica}"
        shutil.rmtree(self.root, ignore_errors=True)  # an earlier life's copies: nothing loads them now
        self.learner_url = None if learner_url is None else learner_url.rstrip("/")
        self._secret = secret
        self._session: aiohttp.ClientSession | None = None
        self._lock = asyncio.Lock()  # one fetch at a time: a retried push must not race its first try
        self._loading: Counter[str] = Counter()  # versions between their copy and the engine's load: kept

    @contextlib.asynccontextmanager
    async def loading(self, req: LoadAdapterRequest) -> AsyncIterator[str]:
        """`local_path`, with the version's copy kept from `sweep` until the block (the engine's load) ends."""
        key = req.adapter.key
        self._loading[key] += 1
        try:
            yield await self.local_path(req)
        finally:
            self._loading[key] -= 1
            if not self._loading[key]:
                del self._loading[key]

    def copy_dir(self, adapter: AdapterRef) -> Path:
        """Its copy's folder: one per life of the name (AdapterRef.life), as its key."""
        return self.root / adapter.name / (f"v{adapter.version:06d}" + (f".{adapter.life}" if adapter.life else ""))

    async def local_path(self, req: LoadAdapterRequest) -> str:
        """A folder on this host that holds the version: the learner's path as given, our copy, or a fresh
        copy from `req.source_url`, which must be this replica's learner. Without a source URL the path is used
        as given (the engine's check then says what is wrong with it)."""
        if req.source_url is not None and req.source_url.rstrip("/") != self.learner_url:
            raise BadRequest(f"source_url {req.source_url!r} is not this sampler's learner ({self.learner_url}): "
                             "a sampler copies adapter versions only from the learner it was started with",
                             code="foreign_source_url")
        if req.source_url is None or holds(Path(req.path), req.fingerprint):
            return req.path
        copy = self.copy_dir(req.adapter)
        async with self._lock:
            if holds(copy, req.fingerprint):
                return str(copy)
            if self._session is None:
                self._session = aiohttp.ClientSession(headers=auth_headers(self._secret))
            started = time.monotonic()
            await fetch_version(self._session, self.learner_url, req.adapter, copy, req.fingerprint, FETCH_TIMEOUT_S)
        size = sum(f.stat().st_size for f in copy.iterdir())
        log.info("%s: %s not readable here; copied %.1f MB from %s in %.2f s", req.adapter.key, req.path,
                 size / 1e6, req.source_url, time.monotonic() - started)
        return str(copy)

    def forget(self, adapter: AdapterRef) -> None:
        """After the version is unloaded: its copy, if we made one."""
        shutil.rmtree(self.copy_dir(adapter), ignore_errors=True)

    def sweep(self, loaded: Iterable[str]) -> list[str]:
        """Remove the copies of versions neither `loaded` in the engine (`AdapterRef.key`s) nor being loaded;
        returns their keys. Temporary folders of a fetch in progress are left to it."""
        keep = set(loaded) | set(self._loading)
        removed = []
        for folder in sorted(self.root.glob("*/v*")):
            match = _COPY_RE.match(folder.name)
            key = AdapterRef(name=folder.parent.name, version=int(match.group(1)), life=match.group(2) or "").key \
                if match else None
            if key is not None and key not in keep:
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(key)
        if removed:
            log.info("removed copies of versions no longer loaded (their unload never arrived): %s", removed)
        return removed

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
