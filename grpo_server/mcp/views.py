"""What the MCP tools answer: the API's models as compact, bounded dicts for an agent to read (numbers rounded,
long lists cut to their newest items, fields an operator rarely needs left out; the HTTP API has them all)."""

from __future__ import annotations

from typing import Any

from grpo_server.api_models import ExperimentStatus, Health, RatedGroup

DIGITS = 4  # significant digits an agent needs to follow a curve; more only costs its context
TRAIN_FIELDS = ("step", "policy_version", "groups", "loss", "reward_mean", "reward_std", "kl", "mismatch_kl",
                "clipped_fraction", "grad_norm", "tokens", "step_seconds")
PUSH_FIELDS = ("version", "step", "verdict", "push_seconds")
SAMPLING_FIELDS = ("groups", "completions", "completion_tokens", "tokens_per_s", "interval_s")
ERRORS_SHOWN = 3
ALGORITHM_SHOWN = ("loss", "learning_rate", "beta", "batch_groups", "push_every", "max_staleness")


def rounded(value: Any) -> Any:
    """`value` with its floats (at any depth) to DIGITS significant digits."""
    if isinstance(value, float):
        return float(f"{value:.{DIGITS}g}")
    if isinstance(value, dict):
        return {key: rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [rounded(item) for item in value]
    return value


def _pick(record: dict[str, Any] | None, fields: tuple[str, ...]) -> dict[str, Any] | None:
    if record is None:
        return None
    return rounded({key: record[key] for key in ("time", *fields) if record.get(key) is not None})


def health(answer: Health) -> dict[str, Any]:
    return rounded({"status": answer.status, "model": answer.model, "workers": answer.workers,
                    "event_loop_lag_max_s": answer.event_loop_lag_max_s})


def experiment_summary(status: ExperimentStatus) -> dict[str, Any]:
    """One experiment in a list: where it is and how its reward goes."""
    counters = status.counters
    return rounded({
        "name": status.name, "state": status.state, "paused": status.paused,
        "policy_version": status.policy_version, "step": status.step,
        "recent_reward_mean": status.recent_reward_mean,
        "groups_received": counters.groups_received, "groups_trained": counters.groups_trained,
        "episodes_rated": counters.episodes_rated, "queued_groups": status.queued_groups,
        "pending_groups": status.pending_groups, "errors": len(status.errors),
    })


def experiment_details(status: ExperimentStatus, train: list[dict[str, Any]], pushes: list[dict[str, Any]],
                       sampling: list[dict[str, Any]]) -> dict[str, Any]:
    """One experiment's status, its reward curve (one point per train step, `train` oldest first) and the newest
    train, push and sampling records of its metrics log."""
    verification = status.last_verification
    return {
        **experiment_summary(status),
        "learner_version": status.learner_version,
        "kl": rounded(status.kl),
        "groups_dropped_stale": status.counters.groups_dropped_stale,
        "groups_zero_variance": status.counters.groups_zero_variance,
        "last_push_check": None if verification is None else rounded(
            {"version": verification.version, "ok": verification.ok, "mean_abs_diff": verification.mean_abs_diff}),
        "suggested_groups_in_flight": status.suggested_groups_in_flight,
        "errors": status.errors[-ERRORS_SHOWN:],
        "config": {"sampling": status.config.get("sampling"),
                   "algorithm": {key: value for key, value in (status.config.get("algorithm") or {}).items()
                                 if key in ALGORITHM_SHOWN},
                   "lora_r": (status.config.get("lora") or {}).get("r")},
        "reward_curve": [rounded({"step": r.get("step"), "reward_mean": r.get("reward_mean"),
                                  "reward_std": r.get("reward_std")}) for r in train],
        "last_train": _pick(train[-1] if train else None, TRAIN_FIELDS),
        "last_push": _pick(pushes[-1] if pushes else None, PUSH_FIELDS),
        "last_sampling": _pick(sampling[-1] if sampling else None, SAMPLING_FIELDS),
    }


def metrics_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Metrics log records with their null fields left out."""
    return [rounded({key: value for key, value in record.items() if value is not None}) for record in records]


def rated_group(group: RatedGroup) -> dict[str, Any]:
    """A rated group with what is empty for its kind left out."""
    shown = group.model_dump(exclude={"completions", "episodes", "completions_total"})
    if group.kind == "episodes":
        shown["episodes"] = [episode.model_dump() for episode in group.episodes]
    else:
        shown["completions"] = [completion.model_dump() for completion in group.completions]
        if group.completions_total > len(group.completions):
            shown["completions_not_shown"] = group.completions_total - len(group.completions)
    return rounded(shown)
