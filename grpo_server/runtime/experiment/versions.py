"""An experiment's versions on the samplers: which one serves, which stay loaded (in use, being checked, named by a
client) and which go. Part of `Experiment` (owner.py), whose fields they read and write."""

from __future__ import annotations

import contextlib
import math
from typing import AsyncIterator, Iterator

from grpo_server.api_models import VerificationResult
from grpo_server.protocol.errors import TooManyRequests


class VersionVerbs:
    """`Experiment`'s versions (its fields are declared in owner.py)."""

    def serve(self, version: int, path: str) -> None:
        """`version`, loaded on every sampler, is served from now on; versions nobody uses are unloaded."""
        self.adapter_paths[version] = path
        self.serving_version = version
        self.retire_unused_versions()

    def learned(self, version: int, step: int) -> None:
        """The learner wrote `version`: its weights after `step` optimizer steps."""
        self.learner_version = version
        self.version_steps[version] = step

    def pushed(self, seconds: float, at: float) -> None:
        """A push took `seconds` and ended `at` (epoch seconds)."""
        self.last_push_seconds = seconds
        self.last_push_at = at

    def keep_for_check(self, version: int) -> None:
        """Keep `version` loaded on the samplers until `checked` (a probe may score it)."""
        self.versions_in_check.add(version)

    def checked(self, version: int) -> None:
        self.versions_in_check.discard(version)
        self.retire_unused_versions()

    def retire_unused_versions(self) -> None:
        """Unload versions that are neither served, nor used by an in-flight request, nor being checked."""
        for version in [v for v in self.adapter_paths
                        if v != self.serving_version and self.inflight[v] == 0 and v not in self.versions_in_check]:
            del self.adapter_paths[version]
            self.inflight.pop(version, None)
            if self.workers is not None:
                self.spawn(self.workers.unload_everywhere(self.adapter(version)),
                           f"unload-{self.name}-v{version}", finish_on_stop=True)

    @contextlib.contextmanager
    def pinned_serving_version(self, version: int | None = None) -> Iterator[int]:
        """The serving version (or `version`, loaded), kept loaded on the samplers until the block ends even if a
        push replaces it."""
        version = self.serving_version if version is None else version
        self.inflight[version] += 1
        try:
            yield version
        finally:
            self.inflight[version] -= 1
            if version != self.serving_version:
                self.retire_unused_versions()

    @contextlib.asynccontextmanager
    async def version_loaded(self, version: int, path: str) -> AsyncIterator[None]:
        """`version` (its folder `path`) loaded on every sampler, and kept loaded while the block runs: a Tinker
        sampler names saved weights the samplers may have let go since (only the serving version, versions in use
        and versions being checked stay loaded). At most max_loaded_versions of this experiment are loaded at
        once, as for its pushes: the samplers' adapter table is shared by every experiment, and one key sampling
        many old versions would fill it (429 while it would go over)."""
        with self.pinned_serving_version(version):  # pinned first: nothing retires it between load and use
            if version not in self.adapter_paths:
                limit = self.server.max_loaded_versions if self.server is not None else math.inf
                if len(self.adapter_paths) + len(self.versions_loading - {version}) >= limit:
                    raise TooManyRequests(f"{len(self.adapter_paths)} versions of {self.name!r} are loaded on the "
                                          f"samplers (max_loaded_versions {limit}); retry once fewer are in use",
                                          code="too_many_loaded_versions", retry_after=2.0)
                self.versions_loading.add(version)
                try:
                    await self.workers.load_everywhere(self.adapter(version), path)
                finally:
                    self.versions_loading.discard(version)
                self.adapter_paths[version] = path
            yield

    def name_version(self, version: int) -> None:
        """A client names `version` (see `named_versions`): pruning keeps it until `unname_version`."""
        self.named_versions[version] += 1

    def unname_version(self, version: int) -> None:
        self.named_versions[version] -= 1
        if self.named_versions[version] <= 0:
            del self.named_versions[version]

    def verified(self, result: VerificationResult) -> None:
        if self.last_verification is None or self.last_verification.version <= result.version:
            self.last_verification = result
