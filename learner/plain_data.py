"""The learner's `.pt` data (optimizer states, random states, the shares and shards ranks send each other) written
as plain values and read back as data only, the same on every Python.

Why plain values: a DeepSpeed optimizer's `state_dict()` holds a few objects besides tensors and containers (its
ZeRO stage, an `Enum`; its loss scalers; the fragment addresses of its parameter mappings). Pickled as they are,
their bytes depend on the Python that wrote them: an `Enum` member pickles as `EnumClass(value)` on CPython
3.11.7, but as `getattr(EnumClass, 'NAME')` on 3.11.2 (Debian 12's, the image's), and a weights-only load refuses
`getattr`. So `save_data` writes each such object as a tagged dict of plain values (`{TAG: "module.Class",
"value": ...}` for an enum, `{TAG: ..., "fields": {...}}` for the others) and `load_data` builds it again: the
file holds tensors, numbers, strings and containers only, and reads back on any Python that runs torch.

`load_data` reads with `torch.load(weights_only=True)`: any global besides torch's tensors and containers is an
UnpicklingError before anything runs, so a file put in the run directory cannot run code in the learner. For the
files written before this format it also accepts the classes themselves (`optimizer_classes`: what CPython
3.11.7 wrote), and `getattr(EnumClass, 'NAME')` as 3.11.2 wrote it, through `_enum_member`: not `getattr`, but a
look-up of a member's name in one of those enums, refused for anything else. Such an old file is read back as it
was and written in this format at the next checkpoint.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from enum import Enum
from functools import cache
from typing import IO, Any

import torch

TAG = "__grpo_object__"  # the key of a tagged dict: no DeepSpeed or torch state dict uses it
# Values torch.load(weights_only=True) builds itself: written as they are.
_PLAIN = (torch.Tensor, torch.Size, torch.dtype, torch.device, str, bytes, int, float, bool, type(None))


@cache
def optimizer_classes() -> dict[str, type]:
    """The classes besides tensors and containers in a DeepSpeed optimizer's `state_dict()`, by qualified name:
    ZeRO-1/2's loss scaler (static; dynamic under fp16), its stage, and the fragment addresses of its parameter
    mappings. Each is data (numbers in its fields)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return {_qualified(c): c for c in (LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address)}


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def to_plain(value: Any) -> Any:
    """`value` with every `optimizer_classes` object replaced by a tagged dict of plain values. TypeError for any
    other object: written as it is, it would not read back (better the write fails than a later resume)."""
    if isinstance(value, Enum):  # before _PLAIN: ZeroStageEnum is an int too
        name = _qualified(type(value))
        if name not in optimizer_classes():
            raise TypeError(f"cannot write {name} into the learner's data: not one of its known classes")
        return {TAG: name, "value": value.value}
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, dict):
        if TAG in value:
            raise TypeError(f"a dict with the reserved key {TAG!r} cannot be written as data")
        return type(value)((k, to_plain(v)) for k, v in value.items()) if isinstance(value, OrderedDict) \
            else {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_plain(v) for v in value)
    name = _qualified(type(value))
    if name not in optimizer_classes():
        raise TypeError(f"cannot write {name} into the learner's data: not one of its known classes")
    return {TAG: name, "fields": to_plain(vars(value))}


def from_plain(value: Any) -> Any:
    """`to_plain`'s inverse: each tagged dict built again as its class (only `optimizer_classes`)."""
    if isinstance(value, dict):
        if TAG in value:
            cls = optimizer_classes().get(value[TAG])
            if cls is None:
                raise pickle.UnpicklingError(f"unknown class {value[TAG]!r} in the learner's data")
            if issubclass(cls, Enum):
                return cls(value["value"])
            built = cls.__new__(cls)  # no __init__: the fields are set as they were saved
            built.__dict__.update(from_plain(value["fields"]))
            return built
        return type(value)((k, from_plain(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(from_plain(v) for v in value)
    return value


def save_data(content: Any, file: IO[bytes]) -> None:
    """`content` (tensors, containers and `optimizer_classes` objects) into `file` with `torch.save`, as plain
    values. CUDA tensors are copied off the device as they are saved."""
    torch.save(to_plain(content), file)


def load_data(source: Any, map_location: str | None = None) -> Any:
    """What `save_data` wrote (a file's path, or a buffer another rank sent), or an older file of the learner's
    (module docstring), read back as data. The one place that reads such data."""
    allowed: list[Any] = [*optimizer_classes().values(), (_enum_member, "builtins.getattr")]
    with torch.serialization.safe_globals(allowed):
        return from_plain(torch.load(source, weights_only=True, map_location=map_location))


def _enum_member(cls: Any, name: Any) -> Enum:
    """How a file pickled on CPython 3.11.2 names an enum member, `getattr(EnumClass, 'NAME')`, read as a member
    look-up in one of `optimizer_classes`' enums: nothing else is reached, nothing is called."""
    if not (isinstance(cls, type) and issubclass(cls, Enum) and cls in optimizer_classes().values()
            and isinstance(name, str) and name in cls.__members__):
        raise pickle.UnpicklingError(f"getattr({cls!r}, {name!r}) in the learner's data: only a member of "
                                     f"{sorted(optimizer_classes())}'s enums may be named this way")
    return cls.__members__[name]
