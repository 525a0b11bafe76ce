"""Adapter downloads on threads of their own, a few per key (grpo_server/api/native/downloads.py), and journal
writes on theirs (grpo_server/runtime/journal.py): neither waits behind the other (issue 46)."""

from __future__ import annotations

import asyncio
import io
import os
import tarfile
import threading

import pytest

from grpo_server.api.native.downloads import Downloads
from grpo_server.protocol.errors import ApiError
from grpo_server.runtime import journal


async def test_a_key_holds_a_few_downloads_at_once_and_archives_read_back(tmp_path):
    downloads = Downloads(threads=2, per_key=2)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "adapter_config.json").write_text("{}")
    with downloads.slot("alice"), downloads.slot("alice"):
        with pytest.raises(ApiError) as caught:
            with downloads.slot("alice"):
                pass
        assert caught.value.status == 429 and caught.value.code == "too_many_downloads"
        with downloads.slot("bob"):  # another key is not held back
            body = await downloads.tar_gz(tmp_path, "exp-v000001")
    with downloads.slot("alice"):  # places come back
        pass
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:gz") as archive:
        assert sorted(archive.getnames()) == ["exp-v000001/adapter_config.json", "exp-v000001/adapter_model.safetensors"]
    downloads.close()


async def test_journal_writes_do_not_wait_behind_the_default_executor(tmp_path):
    """asyncio's default executor, which adapter archives and every other `to_thread` used, all busy: a
    journal append still runs at once, so a feedback's 202 does not wait."""
    release = threading.Event()
    blocked = [asyncio.to_thread(release.wait) for _ in range(40)]  # more than its threads, whatever the box
    waiting = asyncio.gather(*blocked)
    try:
        await asyncio.sleep(0.1)
        written = await asyncio.wait_for(journal._on_journal_thread(lambda: "written"), timeout=5)
        assert written == "written"
    finally:
        release.set()
        await waiting


async def test_a_versions_archive_is_made_once_and_a_new_folder_is_another(tmp_path):
    downloads = Downloads(cache_bytes=10_000)
    folder = tmp_path / "v000001"
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(b"\1" * 100)
    first = await downloads.tar_gz(folder, "exp-v000001")
    made = []
    real = __import__("grpo_server.api.native.downloads", fromlist=["tar_gz"])
    original = real.tar_gz
    real.tar_gz = lambda *args: made.append(args) or original(*args)
    try:
        assert await downloads.tar_gz(folder, "exp-v000001") == first and made == []  # from the cache
        os.rename(folder, tmp_path / "old")  # a name's later life: the same path, another folder
        folder.mkdir()
        (folder / "adapter_model.safetensors").write_bytes(b"\2" * 100)
        again = await downloads.tar_gz(folder, "exp-v000001")
        assert len(made) == 1 and again != first
    finally:
        real.tar_gz = original
        downloads.close()


def test_a_key_has_a_budget_of_downloads_a_minute():
    downloads = Downloads(per_key=8, per_key_per_minute=3)
    for _ in range(3):
        with downloads.slot("alice"):
            pass
    with pytest.raises(ApiError) as caught:
        with downloads.slot("alice"):
            pass
    assert caught.value.status == 429 and 0 < caught.value.retry_after <= 60
    with downloads.slot("bob"):  # another key has its own
        pass
    downloads.close()
