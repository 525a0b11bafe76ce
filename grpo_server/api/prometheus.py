"""`GET /metrics`: the front end's state in the Prometheus text format (version 0.0.4), through
prometheus_client.

Collected on each scrape from what the orchestrator already holds (experiment counters, queues, the last
train step's metrics, worker states) plus two things kept for it: HTTP requests by route and status
(`HttpCounter`, counted by the app's middleware) and a histogram of the staleness of trained groups (the
experiment's `staleness` counter). One custom collector yields them as metric families; it lives in a
registry of the app's own (never prometheus_client's global one: tests run several apps in one process),
and `generate_latest` writes the text.

What a scrape reads, and nothing else: the orchestrator's `experiments` (name -> experiment),
`groups.pending_count(name)` and `workers.states()`; per experiment `name`, `serving_version`, `step`,
`counters` (`groups_sampled`, `groups_received`, `groups_trained`, `groups_dropped_stale`, `groups_dropped_failed`,
`groups_zero_variance`, `groups_expired`, `episodes_*`, `episode_turns`, `completions_sampled`,
`completions_external`, `tokens_sampled`),
`queue` (its length), `recent_rewards`, `last_metrics` (`kl`, `mismatch_kl`, `mismatch_kl_fresh`,
`offpolicy_kl_stale`, `rollout_corrected_fraction`, `clipped_fraction`, `seconds`),
`last_push_seconds` and `staleness` (versions behind -> trained groups); and the orchestrator's `trackers`
(each experiment tracker's written / dropped / failed records, grpo_server/trackers/). Server-wide: the event loop's lag
(`loop_lag`) and the tokens held against the token budget (`budget.in_use`).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

if TYPE_CHECKING:
    from grpo_server.runtime.experiment import Experiment
    from grpo_server.runtime.orchestrator import Orchestrator
    from grpo_server.trackers import TrackerSet

STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16)
GROUP_OUTCOMES = ("sampled", "received", "trained", "dropped_stale", "dropped_failed", "zero_variance", "expired")
LAST_STEP = (("kl", "grpo_kl", "KL to the base model, last step (absent when beta = 0)"),
             ("mismatch_kl", "grpo_mismatch_kl", "KL(sampler || learner) per trained token, last step"),
             ("mismatch_kl_fresh", "grpo_mismatch_kl_fresh", "KL(sampler || learner) per token the learner's "
              "current version sampled (numeric mismatch), last step (absent when none)"),
             ("offpolicy_kl_stale", "grpo_offpolicy_kl_stale", "KL(sampler || learner) per token older versions "
              "sampled (mostly policy change), last step (absent when none)"),
             ("rollout_corrected_fraction", "grpo_rollout_corrected_fraction",
              "Tokens capped or masked by the rollout correction, last step"),
             ("clipped_fraction", "grpo_clipped_fraction", "Tokens clipped, last step"),
             ("seconds", "grpo_learner_step_seconds", "Learner time of the last step"))
# generate_latest writes the 0.0.4 text format (prometheus_client's own servers answer it with this type;
# its CONTENT_TYPE_LATEST names the 1.0.0 format, which they send only to a scraper that asks for it).
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4


class HttpCounter:
    """Requests by (method, route template, status), counted by the app's middleware; one per app."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str, int]] = Counter()

    def add(self, method: str, route: str, status: int) -> None:
        self.counts[(method, route, status)] += 1


class FrontEndCollector(Collector):
    """Every metric of `/metrics`, read afresh from the orchestrator at each `collect()`."""

    def __init__(self, orchestrator: Callable[[], "Orchestrator"], http: HttpCounter) -> None:
        self.orchestrator = orchestrator
        self.http = http

    def collect(self) -> Iterator[Metric]:
        orchestrator = self.orchestrator()
        experiments = list(orchestrator.experiments.values())
        pending = {exp.name: orchestrator.groups.pending_count(exp.name) for exp in experiments}
        trackers = {exp.name: exp.trackers for exp in experiments if exp.trackers is not None}
        families = families_of(experiments, pending, orchestrator.workers.states(), self.http, trackers)
        families += server_families(orchestrator)
        yield from (family for family in families if family.samples)  # as before: no family without samples


def server_families(orchestrator: "Orchestrator") -> list[Metric]:
    """The front end's own load: the event loop's lag, and the tokens held per experiment and in all."""
    lag = GaugeMetricFamily("grpo_event_loop_lag_seconds", "Event-loop lag over the last minute, by quantile "
                            "(1: the largest)", labels=["quantile"])
    for q in (0.5, 0.99, 1.0):
        lag.add_metric([str(q)], orchestrator.loop_lag.quantile(q) if q < 1 else orchestrator.loop_lag.recent_max())
    held = GaugeMetricFamily("grpo_held_tokens", "Tokens held in memory for feedback and training, and reserved by "
                             "requests being sampled (experiment=\"\": the whole server)", labels=["experiment"])
    held.add_metric([""], orchestrator.budget.in_use(None))
    for name in orchestrator.experiments:
        held.add_metric([name], orchestrator.budget.in_use(name))
    return [lag, held]


def families_of(experiments: Iterable["Experiment"], pending: dict[str, int], worker_states: dict[str, str],
                http: HttpCounter, trackers: dict[str, "TrackerSet"] | None = None) -> list[Metric]:
    def gauge(name: str, help_text: str, *labels: str) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, help_text, labels=labels)

    def counter(name: str, help_text: str, *labels: str) -> CounterMetricFamily:
        return CounterMetricFamily(name, help_text, labels=labels)  # the name ends in _total, as exposed

    worker_up = gauge("grpo_worker_up", "1 if the worker is ready, else 0 (see the state label)", "worker", "state")
    for worker, state in worker_states.items():
        worker_up.add_metric([worker, state], 1 if state == "ready" else 0)
    requests = counter("grpo_http_requests_total", "HTTP requests by route template and status",
                       "method", "route", "status")
    for (method, route, status), count in sorted(http.counts.items()):
        requests.add_metric([method, route, str(status)], count)

    exp_gauge = lambda name, help_text: gauge(name, help_text, "experiment")  # noqa: E731
    policy_version = exp_gauge("grpo_policy_version", "Adapter version served for new completions")
    learner_step = exp_gauge("grpo_learner_step", "Optimizer steps taken")
    groups = counter("grpo_groups_total", "Groups by what happened to them", "experiment", "outcome")
    completions = counter("grpo_completions_total", "Completions sampled, and external ones received",
                          "experiment", "source")
    episodes = counter("grpo_episodes_total", "Episodes by what happened to them (turns: their turns sampled)",
                       "experiment", "outcome")
    tokens = counter("grpo_sampled_tokens_total", "Completion tokens sampled (rate() is tokens/s)", "experiment")
    queued = exp_gauge("grpo_queued_groups", "Rated groups waiting for the learner")
    pending_groups = exp_gauge("grpo_pending_groups", "Sampled groups awaiting feedback")
    reward_mean = exp_gauge("grpo_reward_mean", "Mean reward of the recent groups")
    last_step = {key: exp_gauge(metric, help_text) for key, metric, help_text in LAST_STEP}
    push_seconds = exp_gauge("grpo_push_seconds", "Last push: save, load on every sampler, serve")
    tracker_records = counter("grpo_tracker_records_total", "Metrics records handed to an experiment tracker, by "
                              "outcome (written, dropped: its buffer was full, errors)", "experiment", "tracker",
                              "outcome")
    staleness = HistogramMetricFamily("grpo_trained_staleness",
                                      "Optimizer steps between sampling a group and training on it",
                                      labels=["experiment"])

    for exp in experiments:
        name, c = exp.name, exp.counters
        policy_version.add_metric([name], exp.serving_version)
        learner_step.add_metric([name], exp.step)
        for outcome in GROUP_OUTCOMES:
            groups.add_metric([name, outcome], getattr(c, f"groups_{outcome}"))
        for outcome in ("started", "rated", "expired"):
            episodes.add_metric([name, outcome], getattr(c, f"episodes_{outcome}"))
        episodes.add_metric([name, "turns"], c.episode_turns)
        completions.add_metric([name, "sampled"], c.completions_sampled)
        completions.add_metric([name, "external"], c.completions_external)
        tokens.add_metric([name], c.tokens_sampled)
        queued.add_metric([name], len(exp.queue))
        pending_groups.add_metric([name], pending.get(name, 0))
        if exp.recent_rewards:
            reward_mean.add_metric([name], sum(exp.recent_rewards) / len(exp.recent_rewards))
        metrics = exp.last_metrics or {}
        for key, family in last_step.items():
            if metrics.get(key) is not None:
                family.add_metric([name], float(metrics[key]))
        if exp.last_push_seconds is not None:
            push_seconds.add_metric([name], exp.last_push_seconds)
        # Cumulative buckets, as Prometheus has them; `le` written as before ("0", not "0.0").
        buckets = [(str(bound), sum(n for s, n in exp.staleness.items() if s <= bound))
                   for bound in STALENESS_BUCKETS]
        buckets.append(("+Inf", sum(exp.staleness.values())))
        staleness.add_metric([name], buckets, sum_value=sum(s * n for s, n in exp.staleness.items()))
        for tracker, counts in (trackers[name].counts() if trackers and name in trackers else {}).items():
            for outcome in ("written", "dropped", "errors"):
                tracker_records.add_metric([name, tracker, outcome], getattr(counts, outcome))

    return [worker_up, requests, policy_version, learner_step, groups, episodes, completions, tokens, queued,
            pending_groups, reward_mean, *last_step.values(), push_seconds, staleness, tracker_records]


def registry(http: HttpCounter, orchestrator: Callable[[], "Orchestrator"]) -> CollectorRegistry:
    """An app's registry (made with the app; `http` is the app's own). `orchestrator` is called at each scrape:
    the orchestrator only exists once the workers are up."""
    made = CollectorRegistry(auto_describe=False)
    made.register(FrontEndCollector(orchestrator, http))
    return made


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
