"""Adapter downloads (`GET /v1/experiments/{name}/adapter`): each a .tar.gz built on a small thread pool of their
own, at most `per_key` at once for one key (429 beyond).

Why apart: building the archive reads and compresses the adapter's files for up to seconds. On asyncio's default
executor (a few threads on a small box) it shared the threads with every journal append, so one key's downloads
delayed every tenant's feedback 202 (issue 46). The archive is compressed at level 1: an adapter's float weights
barely compress, and the default level 9 spent most of the time for a few percent.

A version's folder never changes once published (written whole, then renamed into place), so its archive is made
once: the newest archives are kept, up to CACHE_BYTES, under the folder's identity (its inode and its files' sizes
and times: a name's later life, or a version pruned and written again, is another folder). A client that downloads
the same version over and over costs the front end the bytes sent, not the compression (the hostile-tenant round,
scripts/benchmarks/hostile.py, does it from several threads).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import tarfile
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

from grpo_server.protocol.errors import TooManyRequests

COMPRESS_LEVEL = 1
CACHE_BYTES = 64 * 1024 * 1024


class Downloads:
    def __init__(self, threads: int = 2, per_key: int = 2, cache_bytes: int = CACHE_BYTES):
        self.per_key = per_key
        self.cache_bytes = cache_bytes
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="adapter-download")
        self._running: Counter[str] = Counter()
        self._cache: OrderedDict[tuple, bytes] = OrderedDict()  # identity -> archive, oldest use first
        self._cached = 0  # bytes in the cache

    @contextlib.contextmanager
    def slot(self, key: str) -> Iterator[None]:
        """One of `key`'s `per_key` downloads at once; 429 when it holds them all."""
        if self._running[key] >= self.per_key:
            raise TooManyRequests(f"{self._running[key]} adapter downloads of this key are running (max "
                                  f"{self.per_key} at once): retry when one has finished", code="too_many_downloads",
                                  retry_after=2.0)
        self._running[key] += 1
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
