"""Adapter downloads (`GET /v1/experiments/{name}/adapter`): each a .tar.gz built on a small thread pool of their
own, at most `per_key` at once and `per_key_per_minute` a minute for one key (429 beyond).

Why apart: building the archive reads and compresses the adapter's files for up to seconds. On asyncio's default
executor (a few threads on a small box) it shared the threads with every journal append, so one key's downloads
delayed every tenant's feedback 202 (issue 46). The archive is compressed at level 1: an adapter's float weights
barely compress, and the default level 9 spent most of the time for a few percent.

A version's folder never changes once published (written whole, then renamed into place), so its archive is made
once: the newest archives are kept, up to CACHE_BYTES, under the folder's identity (its inode and its files' sizes
and times: a name's later life, or a version pruned and written again, is another folder). A client that downloads
the same version over and over costs the front end the bytes sent, not the compression (the hostile-tenant round,
scripts/benchmarks/hostile.py, does it from several threads). Sending them is the event loop's work, though: a
key that downloaded a cached archive as fast as it could (170 a second of a few MB each, measured there) slowed
every other tenant's requests 5-6x, so a key also has a budget a minute, well above a client's need (one download
per new version).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import tarfile
import time
from collections import Counter, OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

from grpo_server.protocol.errors import TooManyRequests

COMPRESS_LEVEL = 1
CACHE_BYTES = 64 * 1024 * 1024
PER_KEY_PER_MINUTE = 60


class Downloads:
    def __init__(self, threads: int = 2, per_key: int = 2, cache_bytes: int = CACHE_BYTES,
                 per_key_per_minute: int = PER_KEY_PER_MINUTE):
        self.per_key = per_key
        self.per_key_per_minute = per_key_per_minute
        self._recent: dict[str, deque[float]] = {}  # key -> monotonic times of its downloads in the last minute
        self.cache_bytes = cache_bytes
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="adapter-download")
        self._running: Counter[str] = Counter()
        self._cache: OrderedDict[tuple, bytes] = OrderedDict()  # identity -> archive, oldest use first
        self._cached = 0  # bytes in the cache

    @contextlib.contextmanager
    def slot(self, key: str) -> Iterator[None]:
        """One of `key`'s `per_key` downloads at once, and of its `per_key_per_minute` a minute; 429 beyond."""
        now, recent = time.monotonic(), self._recent.setdefault(key, deque())
        while recent and recent[0] <= now - 60:
            recent.popleft()
        if len(recent) >= self.per_key_per_minute:
            raise TooManyRequests(f"this key downloaded {len(recent)} adapters in the last minute (max "
                                  f"{self.per_key_per_minute}): retry later", code="too_many_downloads",
                                  retry_after=max(0.1, recent[0] + 60 - now))
        if self._running[key] >= self.per_key:
            raise TooManyRequests(f"{self._running[key]} adapter downloads of this key are running (max "
                                  f"{self.per_key} at once): retry when one has finished", code="too_many_downloads",
                                  retry_after=2.0)
        self._running[key] += 1
        recent.append(now)
        try:
            yield
        finally:
            self._running[key] -= 1
            if not self._running[key]:
                del self._running[key]

    async def tar_gz(self, folder: Path, top: str) -> bytes:
        """`folder` as a .tar.gz under `top/`: from the cache, or made on the download threads and kept."""
        loop = asyncio.get_running_loop()
        identity = (top, *await loop.run_in_executor(self._pool, _identity, folder))
        if identity in self._cache:
            self._cache.move_to_end(identity)
            return self._cache[identity]
        archive = await loop.run_in_executor(self._pool, tar_gz, folder, top)
        if len(archive) <= self.cache_bytes:
            self._cache[identity] = archive
            self._cached += len(archive)
            while self._cached > self.cache_bytes:
                self._cached -= len(self._cache.popitem(last=False)[1])
        return archive

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _identity(folder: Path) -> tuple:
    """What tells this folder from any other of its path: its inode, and each file's name, size and time."""
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir())
    return (str(folder), os.stat(folder).st_ino, *files)


def tar_gz(folder: Path, top: str) -> bytes:
    """`folder`'s files as a .tar.gz whose entries sit under `top/`."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=COMPRESS_LEVEL) as archive:
        for path in sorted(folder.iterdir()):
            archive.add(path, arcname=f"{top}/{path.name}")
    return buffer.getvalue()
