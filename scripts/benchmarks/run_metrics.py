"""What a server run's metrics log (RUN_DIR/metrics/<name>.jsonl, grpo_server/runtime/metrics_log.py) says about
sampler/learner agreement, for the races of end_to_end.py run with other settings (a bf16 sampler, say)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def learning_summary(metrics_log: Path) -> dict:
    """From the metrics log: the sampler/learner agreement over the race (the free check's mean gap on the
    steps that had one, the mismatch KL, the pushes' verification), for settings such as a bf16 sampler."""
    if not metrics_log.is_file():
        return {}
    rows = [json.loads(line) for line in metrics_log.read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("kind") == "train"]
    checked = [r["sampler_gap_mean"] for r in train if r.get("sampler_gap_tokens")]
    pushes = [r for r in rows if r.get("kind") == "push"]

    def mean(rows: list[dict], key: str) -> float | None:
        values = [r[key] for r in rows if r.get(key) is not None]
        return round(statistics.fmean(values), 5) if values else None

    return {"steps": len(train), "train_s_sum": round(sum(r.get("step_seconds") or 0.0 for r in train), 1),
            "free_check_steps": len(checked),
            "sampler_gap_mean": round(statistics.fmean(checked), 5) if checked else None,
            "mismatch_kl_mean": mean(train, "mismatch_kl"),
            "rollout_corrected_fraction_mean": mean(train, "rollout_corrected_fraction"),
            "pushes_verified": sum(r.get("verified") is True for r in pushes),
            "pushes_failed": sum(r.get("verified") is False for r in pushes),
            "push_mean_abs_diff": mean(pushes, "mean_abs_diff")}
