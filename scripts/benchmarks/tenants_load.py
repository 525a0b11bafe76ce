"""What a tenant's client does and meets in the tenants figure (scripts/benchmarks/tenants.py), against this server
or `vllm serve` (tenants_anchor.py): the load's shape, each tenant, each client's record, and their summary."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .rollouts import percentile

N = 4
MAX_TOKENS = 16
REQUEST_TIMEOUT_S = 900.0
TOPICS = ["rivers", "bridges", "owls", "violins", "glaciers", "markets", "comets", "gardens", "lighthouses",
          "deserts", "trains", "bees", "volcanoes", "libraries", "tides", "kites"]


@dataclass
class Tenant:
    index: int
    name: str
    key: str
    created_at: float
    last_sampled: float | None = None  # monotonic time of its last completion (window or probe)
    last_active_level: int | None = None  # index of the last level it was active at
    prompt_ids: list[int] | None = None  # the chat prompt as this server tokenized it (the anchor sends these)

    @property
    def messages(self) -> list[dict]:
        return [{"role": "user", "content": f"Tenant {self.index}: write two sentences about "
                                            f"{TOPICS[self.index % len(TOPICS)]} and the number {self.index}."}]


@dataclass
class Record:
    """What one tenant's client met in a window."""

    name: str
    latencies: list[float] = field(default_factory=list)  # each completion, 429 back-off included
    tokens: int = 0
    backoffs: int = 0  # 429s waited out
    backoff_s: float = 0.0
    feedback: int = 0  # feedback accepted (2xx)
    errors: Counter = field(default_factory=Counter)  # answers other than 2xx and 429, and calls with no answer

    def summary(self) -> dict:
        lat = self.latencies
        return {"name": self.name, "completions": len(lat), "tokens": self.tokens,
                "p50_s": None if not lat else round(percentile(lat, 0.5), 3),
                "p95_s": None if not lat else round(percentile(lat, 0.95), 3),
                "backoffs_429": self.backoffs, "backoff_s": round(self.backoff_s, 2), "feedback": self.feedback,
                "errors": dict(self.errors)}


def rounded_median(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def load_summary(records: list[Record], seconds: float) -> dict:
    """The window's totals and each tenant's latency percentiles (the median tenant's, and the worst)."""
    tenants = [r.summary() for r in records]
    p50s = [t["p50_s"] for t in tenants if t["p50_s"] is not None]
    p95s = [t["p95_s"] for t in tenants if t["p95_s"] is not None]
    tokens = sum(r.tokens for r in records)
    spread = round(max(p95s) / statistics.median(p95s), 3) if p95s and statistics.median(p95s) > 0 else None
    return {"seconds": round(seconds, 1), "completions": sum(len(r.latencies) for r in records),
            "completion_tokens": tokens, "tok_s": round(tokens / seconds, 1) if seconds > 0 else None,
            "p50_s_median_tenant": rounded_median(p50s), "p95_s_median_tenant": rounded_median(p95s),
            "p95_s_worst_tenant": max(p95s, default=None), "p95_spread": spread,
            "tenants_without_completion": sum(t["completions"] == 0 for t in tenants),
            "answers_429": sum(r.backoffs for r in records),
            "errors": dict(sum((r.errors for r in records), Counter())), "tenants": tenants}


def log_text(path: Path, offset: int = 0) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""
