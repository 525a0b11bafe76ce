"""constraints.txt's exact versions (what CI and the image install), read with `packaging`'s parser."""

from __future__ import annotations

from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent


def pinned_versions(path: Path = ROOT / "constraints.txt") -> dict[str, set[str]]:
    """Each constrained package's versions (a name may be pinned twice, by Python version: aiohttp-sse)."""
    pins: dict[str, set[str]] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        (spec,) = requirement.specifier  # one `==` each: that is what a constraints line is for here
        assert spec.operator == "==", line
        pins.setdefault(canonicalize_name(requirement.name), set()).add(spec.version)
    return pins
