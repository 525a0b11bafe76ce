"""msgpack, the workers' body encoding (and the public API's, on request): one pack, one unpack."""

from __future__ import annotations

from typing import Any

import msgpack
from pydantic import BaseModel

MSGPACK = "application/msgpack"


def pack(obj: Any) -> bytes:
    if isinstance(obj, BaseModel):
        obj = obj.model_dump(mode="json")
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)
