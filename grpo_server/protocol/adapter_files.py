"""An adapter version's files, and how a worker on another host gets them: over the learner's HTTP.

A version is a peft folder of two files (`FILES`), written once by the learner and never changed. Its
safetensors header carries a `fingerprint`, a random id written with it: a folder whose header holds the
same id IS that version, whatever host or path it sits at. A sampler given a version checks the learner's
path first (a shared volume: nothing copied) and fetches the files from the learner's
`GET /adapters/{name}/{version}/{file}` only when that path is not there or holds something else (an
earlier run's folder at the same path on its own disk).

Standard library and aiohttp only: the front end, the sampler and the learner all read this.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import struct
from pathlib import Path

import aiohttp

from grpo_server.protocol.codec import unpack
from grpo_server.protocol.errors import ApiError, NotFound
from grpo_server.protocol.wire import AdapterRef

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
FILES = (CONFIG_FILE, WEIGHTS_FILE)
FINGERPRINT_KEY = "grpo_server_fingerprint"  # in the safetensors metadata; peft and vLLM ignore it
ROUTE = "/adapters/{name}/{version}/{file}"  # the learner's: one file of one version, as is
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
CHUNK_BYTES = 1 << 20
READ_TIMEOUT_S = 60.0  # no byte for this long: the transfer is dead (the whole file may take longer)


class AdapterFetchFailed(ApiError):
    """The version could not be copied from the learner (unreachable, cut off, not a whole version)."""

    status, code = 502, "adapter_fetch_failed"


class VersionPruned(ApiError):
    """The learner deleted the version (`LearnerOptions.keep_versions`, learner/retention.py): gone for good,
    which a 404 (never written, or a wrong name) would not say."""

    status, code = 410, "version_pruned"


def file_url(source_url: str, adapter: AdapterRef, file: str) -> str:
    return source_url.rstrip("/") + ROUTE.format(name=adapter.name, version=adapter.version, file=file)


def weights_header(path: Path) -> dict:
    """The safetensors header of `path`, after checking that the file holds every byte it announces (a
    truncated copy fails here, with its sizes, instead of deep inside vLLM)."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path}: {size} bytes, not a safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{path}: truncated ({size} bytes; its header alone announces {length})")
        header = json.loads(file.read(length))
    end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    if size != 8 + length + end:
        raise ValueError(f"{path}: {size} bytes where its header announces {8 + length + end} (truncated?)")
    return header


def read_fingerprint(folder: Path) -> str | None:
    """The version's fingerprint (None: written before fingerprints, or not a whole version)."""
    try:
        return (weights_header(Path(folder) / WEIGHTS_FILE).get("__metadata__") or {}).get(FINGERPRINT_KEY)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def holds(folder: Path, fingerprint: str | None) -> bool:
    """Whether `folder` is readable here and is the version with this fingerprint (any whole version when the
    fingerprint is unknown: versions written before fingerprints)."""
    folder = Path(folder)
    if not all((folder / name).is_file() for name in FILES):
        return False
    return fingerprint is None or read_fingerprint(folder) == fingerprint


async def fetch_version(session: aiohttp.ClientSession, source_url: str, adapter: AdapterRef, dest: Path,
                        fingerprint: str | None, timeout_s: float) -> Path:
    """Copy the version's files from `source_url` (the learner) into `dest`, atomically: a temporary sibling,
    checked (every byte the header announces, the fingerprint), then renamed. Raises `NotFound` when the
    learner has no such version, `VersionPruned` when it deleted it, `AdapterFetchFailed` for anything else;
    never waits past `timeout_s`."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".tmp-{dest.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_read=READ_TIMEOUT_S)
        for name in FILES:
            await _download(session, file_url(source_url, adapter, name), tmp / name, timeout)
        try:
            found = (weights_header(tmp / WEIGHTS_FILE).get("__metadata__") or {}).get(FINGERPRINT_KEY)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise AdapterFetchFailed(f"{adapter.key} from {source_url}: not a whole version: {exc}") from exc
        if fingerprint is not None and found != fingerprint:
            raise AdapterFetchFailed(f"{adapter.key} from {source_url}: fingerprint {found}, expected {fingerprint} "
                                     "(the learner holds another version under this number)")
        shutil.rmtree(dest, ignore_errors=True)  # an earlier copy that did not match
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _error_message(body: bytes) -> str:
    try:  # a worker's error body (protocol/dispatch.py)
        return str(unpack(body)["error"]["message"])
    except Exception:  # msgpack raises several unrelated types; or not a worker at all
        return body[:300].decode("utf-8", "replace")


async def _download(session: aiohttp.ClientSession, url: str, path: Path, timeout: aiohttp.ClientTimeout) -> None:
    try:
        async with session.get(url, timeout=timeout) as response:
            if response.status != 200:
                message = _error_message(await response.read())
                if response.status == 404:
                    raise NotFound(f"{url}: 404 ({message})", code="version_not_found")
                if response.status == VersionPruned.status:
                    raise VersionPruned(f"{url}: 410 ({message})")
                raise AdapterFetchFailed(f"{url}: {response.status} ({message})")
            with open(path, "wb") as file:
                # aiohttp raises ClientPayloadError when the body ends before its Content-Length.
                async for chunk in response.content.iter_chunked(CHUNK_BYTES):
                    file.write(chunk)
    except asyncio.TimeoutError as exc:
        raise AdapterFetchFailed(f"{url}: timed out") from exc
    except aiohttp.ClientError as exc:
        raise AdapterFetchFailed(f"{url}: {type(exc).__name__}: {exc}") from exc
