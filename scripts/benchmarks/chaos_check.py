"""The chaos soak's invariant checker: the clients' history (chaos_load.py) against what the server holds once it
has recovered and stopped cleanly (so that every step it took is checkpointed, and in its ledger).

Invariants, each a count of breaks (0 to pass) with the first few examples:
- `lost`: a group whose feedback was acknowledged (202, or 409 `duplicate_feedback` after a lost answer) that the
  experiment's ledger (learner/ledger.py, read as a timeline with its rollbacks) neither trained nor passed over
  with a reason. Groups of experiments the soak deleted are not held to this: the delete took them.
- `trained_twice`: a group id trained in two steps of a ledger's timeline, or in the ledgers of two experiments
  (another life's weights), or trained and passed over too.
- `unexplained_trained`: a trained group that no client's feedback named as acknowledged or unknown (an answer
  lost to a fault), beyond the count of such unknown answers without an id (episodes' groups get theirs in the 202).
- `tinker_steps`: a Tinker model whose ledger does not hold the steps its client was answered, less those the
  server named as rolled back, within the steps whose answers were lost.
- `unexplained_5xx`: an answer of 500 or above that is not a 503 with Retry-After; and any 5xx outside the time
  of a fault (from its injection until its recovery, plus `GRACE_S`).
- `versions_fell`: an experiment whose serving version, polled through the soak, went down.
- `unverified`: a pushed version whose check against the learner failed (metrics log `push` lines, `verified`
  false).
- `unanswered`: a client call that never returned, past every timeout (a Tinker future that never ended);
- `unbounded_versions`: an experiment with more adapter versions on disk at the end than pruning keeps
  (`learner.keep_versions`, plus those loaded on the samplers, the checkpoints' and the Tinker client's named ones);
- `unbounded_archives`: more deleted experiments' archives on disk at the end than the server's `archives_kept`;
- `front_end_grew`: the front end's RSS rose more than `RSS_GROWTH_MIB` after the soak's first quarter (warm-up).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from learner import ledger

GRACE_S = 15.0  # after a fault's recovery: answers still in flight from before it, clients catching up
EXAMPLES = 5
RSS_GROWTH_MIB = 200.0
CHECKPOINTS_KEPT = 2  # learner/checkpoint.py KEEP: each may name a version of its own
NAMED_BY_CLIENT = 3  # the soak's Tinker client names its sampler weights s0, s1, s2 (chaos_load.py)


def _breaks(examples: list[Any]) -> dict[str, Any]:
    return {"count": len(examples), "examples": examples[:EXAMPLES]}


def ledgers(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Every live experiment's ledger timeline, by name (archived ones under `archive/<label>`)."""
    found = {}
    for path in sorted(Path(run_dir).glob("checkpoints/*/" + ledger.LEDGER_FILE)):
        found[path.parent.name] = ledger.timeline(ledger.read(path.parent))
    for path in sorted(Path(run_dir).glob("archive/*/**/" + ledger.LEDGER_FILE)):
        label = path.relative_to(Path(run_dir) / "archive").parts[0]  # the key chaos_load.py reads it under too
        found[f"archive/{label}"] = ledger.timeline(ledger.read(path.parent))
    return found


def check(records: list[dict[str, Any]], run_dir: Path, faults: list[dict[str, Any]],
          versions: dict[str, list[tuple[float, int]]], rss_mib: list[float],
          archived: dict[str, list[dict[str, Any]]] | None = None, archives_kept: int | None = None
          ) -> dict[str, Any]:
    """`archived`: the ledgers of the churned experiments' archives, read as each was made (chaos_load.py
    `churn`), by label; `archives_kept`: the server's bound on archives (None: not checked)."""
    timelines = {**(archived or {}), **ledgers(run_dir)}
    deleted = {r["experiment"] for r in records if r.get("op") == "delete"}
    return {
        **_feedback(records, timelines, deleted),
        "tinker_steps": _tinker(records, timelines, run_dir),
        "unexplained_5xx": _five_hundreds(records, faults),
        "versions_fell": _breaks([{"experiment": name, "from": a, "to": b, "at_s": t}
                                  for name, seen in versions.items()
                                  for (_, a), (t, b) in zip(seen, seen[1:]) if b < a]),
        "unverified": _breaks(_unverified(run_dir)),
        "unanswered": _breaks([{k: r.get(k) for k in ("t", "family", "op", "message")} for r in records
                               if r.get("code") == "no_answer"]),
        "unbounded_versions": _breaks(_unbounded_versions(run_dir)),
        "unbounded_archives": _breaks(_unbounded_archives(run_dir, archives_kept)),
        "front_end_grew": _breaks(_grew(rss_mib)),
    }


def _unbounded_versions(run_dir: Path) -> list[dict[str, Any]]:
    from grpo_server.config import ServerConfig
    from grpo_server.protocol.worker_config import LearnerOptions

    bound = (LearnerOptions.model_fields["keep_versions"].default
             + ServerConfig.model_fields["max_loaded_versions"].default + CHECKPOINTS_KEPT + NAMED_BY_CLIENT)
    out = []
    for folder in sorted(Path(run_dir).glob("adapters/*")):
        if folder.name.startswith("tinker-"):  # a Tinker model's live samplers keep their versions too, by design
            continue
        held = sum(1 for v in folder.glob("v*") if v.is_dir())
        if held > bound:
            out.append({"experiment": folder.name, "versions": held, "bound": bound})
    return out


def _unbounded_archives(run_dir: Path, kept: int | None) -> list[dict[str, Any]]:
    from grpo_server.protocol import archive

    root = Path(run_dir) / archive.ROOT
    held = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    return [{"archives": len(held), "archives_kept": kept}] if kept is not None and len(held) > kept else []


def _grew(rss_mib: list[float]) -> list[dict[str, Any]]:
    warm = rss_mib[len(rss_mib) // 4:]
    if warm and max(warm) - warm[0] > RSS_GROWTH_MIB:
        return [{"after_warm_up_mib": round(warm[0], 1), "peak_mib": round(max(warm), 1)}]
    return []


def _feedback(records, timelines, deleted) -> dict[str, Any]:
    acknowledged: dict[str, str] = {}  # group id -> experiment
    unknown_ids: set[str] = set()
    unknown_without_id = 0
    for r in records:
        if r.get("op") != "feedback" or "outcome" not in r:
            continue
        if r["outcome"] == "acknowledged" and not r.get("skipped") and r.get("group_id"):
            acknowledged[r["group_id"]] = r["experiment"]
        elif r["outcome"] == "unknown":
            if r.get("group_id"):
                unknown_ids.add(r["group_id"])
            else:
                unknown_without_id += 1
    trained: dict[str, list[tuple[str, int]]] = defaultdict(list)  # group id -> [(ledger, step)]
    passed: dict[str, list[tuple[str, int, str]]] = defaultdict(list)
    for name, lines in timelines.items():
        for line in lines:
            for group_id in line.get("trained", []):
                trained[group_id].append((name, line["step"]))
            for group_id, reason in line.get("passed_over", {}).items():
                passed[group_id].append((name, line["step"], reason))
    lost = [{"group_id": g, "experiment": e} for g, e in acknowledged.items()
            if e not in deleted and g not in trained and g not in passed]
    # Passed over more than once is not trained: a stale group journalled after its batch's newest entry is queued
    # again by a learner restart (the journal position cannot pass it without passing groups still queued).
    twice = [{"group_id": g, "trained": trained[g], "passed_over": passed.get(g, [])}
             for g in trained if len(trained[g]) > 1 or g in passed]
    unexplained = [g for g in trained if g not in acknowledged and g not in unknown_ids]
    reasons = Counter(reason for entries in passed.values() for _, _, reason in entries)
    return {
        "lost": _breaks(lost),
        "trained_twice": _breaks(twice),
        "unexplained_trained": _breaks(unexplained[unknown_without_id:]),
        "feedback": {"acknowledged": len(acknowledged), "unknown": len(unknown_ids) + unknown_without_id,
                     "trained": len(trained), "passed_over": dict(reasons),
                     "of_deleted_experiments": sum(1 for e in acknowledged.values() if e in deleted)},
    }


def _tinker(records, timelines, run_dir: Path) -> dict[str, Any]:
    try:
        registry = json.loads((Path(run_dir) / "tinker" / "models.json").read_text())
        rows = registry.get("models", registry) if isinstance(registry, dict) else registry
        experiment_of = {row["model_id"]: row["experiment"] for row in rows}
    except (OSError, ValueError, KeyError, TypeError):
        experiment_of = {}
    answered: dict[str, int] = {}
    lost_answers: Counter = Counter()
    for r in records:
        if r.get("family") != "tinker" or not r.get("model_id"):
            continue
        if r["op"] == "optim_step":
            if r.get("status") == 200:
                answered[r["model_id"]] = r["step"]
            elif r.get("rolled_back_to") is not None:
                answered[r["model_id"]] = r["rolled_back_to"]
            elif r.get("code") not in ("RequestFailedError",):  # no answer: it may have been applied
                lost_answers[r["model_id"]] += 1
        elif r.get("rolled_back_to") is not None:
            answered[r["model_id"]] = r["rolled_back_to"]
    breaks = []
    for model_id, steps in answered.items():
        name = experiment_of.get(model_id)
        lines = timelines.get(name, []) if name else []
        held = sum(1 for line in lines if line.get("kind") == "optim_step")
        if not steps <= held <= steps + lost_answers[model_id]:
            breaks.append({"model_id": model_id, "experiment": name, "answered_steps": steps, "ledger_steps": held,
                           "answers_lost": lost_answers[model_id]})
    return {**_breaks(breaks), "models": len(answered)}


def _five_hundreds(records, faults) -> dict[str, Any]:
    windows = [(f["at_s"], f["at_s"] + f.get("held_s", 0) + (f.get("recovered_s") or 0) + GRACE_S) for f in faults]
    breaks = []
    for r in records:
        status = r.get("status")
        if not isinstance(status, int) or status < 500:
            continue
        during = any(start <= r["t"] <= end for start, end in windows)
        if status != 503 or r.get("retry_after") in (None, "") or not during:
            breaks.append({k: r.get(k) for k in ("t", "family", "op", "experiment", "status", "code", "retry_after")})
    return _breaks(breaks)


def _unverified(run_dir: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(Path(run_dir).glob("metrics/*.jsonl")):
        for raw in path.read_text(errors="replace").splitlines():
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if line.get("kind") == "push" and line.get("verified") is False:
                out.append({"experiment": path.stem, "version": line.get("version"), "verdict": line.get("verdict")})
    return out


def breaking_history(invariants: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history records of the broken invariants' examples: every record naming one of their groups, Tinker
    models or 5xx times, in order (what a failing run writes beside its seed)."""
    ids, times = set(), set()
    for value in invariants.values():
        for example in value.get("examples", []) if isinstance(value, dict) else []:
            if isinstance(example, dict):
                ids.update(example[k] for k in ("group_id", "model_id") if example.get(k))
                if "t" in example:
                    times.add(example["t"])
            else:
                ids.add(example)
    return [r for r in records if r.get("group_id") in ids or r.get("model_id") in ids or r["t"] in times]


def answers_by_family(records: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Requests by family and answer (status, and code where there is one)."""
    out: dict[str, Counter] = defaultdict(Counter)
    for r in records:
        label = str(r.get("status")) + (f" {r['code']}" if r.get("code") and r.get("status") != 200 else "")
        out[r["family"]][f"{r['op']} {label}"] += 1
    return {family: dict(sorted(counts.items())) for family, counts in sorted(out.items())}
