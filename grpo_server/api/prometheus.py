"""`GET /metrics`: the front end's state in the Prometheus text format (version 0.0.4).

Rendered on each scrape from what the orchestrator already holds (experiment counters, queues, the last
train step's metrics, worker states) plus two things kept here for it: HTTP requests by route and status,
and a histogram of the staleness of trained groups. No client library: the format is a few lines of
text, and the front end's dependencies stay small.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Iterable

from grpo_server.runtime.experiment import Experiment

STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16)


class HttpCounter:
    """Requests by (method, route template, status), counted by the app's middleware."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str, int]] = Counter()

    def add(self, method: str, route: str, status: int) -> None:
        self.counts[(method, route, status)] += 1


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**labels: object) -> str:
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}" if labels else ""


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


class _Family:
    def __init__(self, name: str, kind: str, help_text: str):
        self.name, self.kind, self.help_text = name, kind, help_text
        self.samples: list[str] = []

    def add(self, value: float, suffix: str = "", **labels: object) -> None:
        self.samples.append(f"{self.name}{suffix}{_labels(**labels)} {_number(value)}")

    def render(self) -> str:
        return "\n".join([f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} {self.kind}", *self.samples])


def render(experiments: Iterable[Experiment], pending: dict[str, int], worker_states: dict[str, str],
           http: HttpCounter) -> str:
    families: dict[str, _Family] = {}

    def family(name: str, kind: str, help_text: str) -> _Family:
        return families.setdefault(name, _Family(name, kind, help_text))

    for state_name, state in worker_states.items():
        family("grpo_worker_up", "gauge", "1 if the worker is ready, else 0 (see the state label)").add(
            1 if state == "ready" else 0, worker=state_name, state=state)
    for (method, route, status), count in sorted(http.counts.items()):
        family("grpo_http_requests_total", "counter", "HTTP requests by route template and status").add(
            count, method=method, route=route, status=status)

    for exp in experiments:
        name, c = exp.name, exp.counters
        family("grpo_policy_version", "gauge", "Adapter version served for new completions").add(
            exp.serving_version, experiment=name)
        family("grpo_learner_step", "gauge", "Optimizer steps taken").add(exp.step, experiment=name)
        groups = family("grpo_groups_total", "counter", "Groups by what happened to them")
        for outcome in ("sampled", "received", "trained", "dropped_stale", "zero_variance", "expired"):
            groups.add(getattr(c, f"groups_{outcome}"), experiment=name, outcome=outcome)
        family("grpo_completions_total", "counter", "Completions sampled, and external ones received").add(
            c.completions_sampled, experiment=name, source="sampled")
        family("grpo_completions_total", "counter", "").add(c.completions_external, experiment=name,
                                                             source="external")
        family("grpo_sampled_tokens_total", "counter", "Completion tokens sampled (rate() is tokens/s)").add(
            c.tokens_sampled, experiment=name)
        family("grpo_queued_groups", "gauge", "Rated groups waiting for the learner").add(
            len(exp.queue), experiment=name)
        family("grpo_pending_groups", "gauge", "Sampled groups awaiting feedback").add(
            pending.get(name, 0), experiment=name)
        if exp.recent_rewards:
            family("grpo_reward_mean", "gauge", "Mean reward of the recent groups").add(
                sum(exp.recent_rewards) / len(exp.recent_rewards), experiment=name)
        metrics = exp.last_metrics or {}
        for key, metric, help_text in (("kl", "grpo_kl", "KL to the base model, last step"),
                                       ("clipped_fraction", "grpo_clipped_fraction", "Tokens clipped, last step"),
                                       ("seconds", "grpo_learner_step_seconds", "Learner time of the last step")):
            if metrics.get(key) is not None:
                family(metric, "gauge", help_text).add(float(metrics[key]), experiment=name)
        if exp.last_push_seconds is not None:
            family("grpo_push_seconds", "gauge", "Last push: save, load on every sampler, serve").add(
                exp.last_push_seconds, experiment=name)
        staleness = family("grpo_trained_staleness", "histogram",
                           "Versions between sampling a group and training on it")
        for bound in STALENESS_BUCKETS:  # cumulative, as Prometheus buckets are
            staleness.add(sum(n for s, n in exp.staleness.items() if s <= bound), "_bucket", experiment=name,
                          le=bound)
        total = sum(exp.staleness.values())
        staleness.add(total, "_bucket", experiment=name, le="+Inf")
        staleness.add(sum(s * n for s, n in exp.staleness.items()), "_sum", experiment=name)
        staleness.add(total, "_count", experiment=name)
    return "\n".join(f.render() for f in families.values()) + "\n"
