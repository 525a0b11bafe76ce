"""Adapter downloads (`GET /v1/experiments/{name}/adapter`): each a .tar.gz built on a small thread pool of their
own, at most `per_key` at once for one key (429 beyond).

Why apart: building the archive reads and compresses the adapter's files for up to seconds. On asyncio's default
executor (a few threads on a small box) it shared the threads with every journal append, so one key's downloads
delayed every tenant's feedback 202 (issue 46). The archive is compressed at level 1: an adapter's float weights
barely compress, and the default level 9 spent most of the time for a few percent.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import tarfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

from grpo_server.protocol.errors import TooManyRequests

COMPRESS_LEVEL = 1


class Downloads:
    def __init__(self, threads: int = 2, per_key: int = 2):
        self.per_key = per_key
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="adapter-download")
        self._running: Counter[str] = Counter()

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
        return await asyncio.get_running_loop().run_in_executor(self._pool, tar_gz, folder, top)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def tar_gz(folder: Path, top: str) -> bytes:
    """`folder`'s files as a .tar.gz whose entries sit under `top/`."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=COMPRESS_LEVEL) as archive:
        for path in sorted(folder.iterdir()):
            archive.add(path, arcname=f"{top}/{path.name}")
    return buffer.getvalue()
