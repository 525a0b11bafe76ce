"""The chaos soak's block of BENCHMARKS.md (scripts/benchmarks/chaos.py): its invariants, its faults by kind with
their recovery times, the answers by API family, throughput in and out of faults, and what stayed bounded."""

from __future__ import annotations

from .table_cells import _error, _f, _run_line

INVARIANTS = {
    "lost": "acknowledged groups neither trained nor passed over with a reason",
    "trained_twice": "groups trained in two steps of a ledger's timeline or in two experiments, or trained and passed "
                     "over",
    "unexplained_trained": "trained groups no client was acknowledged for (nor lost an answer for)",
    "tinker_steps": "Tinker models whose durable steps differ from the answered ones (less named rollbacks)",
    "unexplained_5xx": "5xx other than 503 with Retry-After during a fault",
    "versions_fell": "serving versions that went down",
    "unverified": "pushed versions whose check against the learner failed",
    "unanswered": "client calls that never returned",
    "unbounded_versions": "experiments with more adapter versions on disk than pruning keeps",
    "unbounded_archives": "deleted experiments' archives on disk beyond the server's archives_kept",
    "front_end_grew": "the front end's RSS rising over 200 MiB after warm-up",
}


def chaos_block(meta: dict, ch: dict) -> list[str]:
    err = _error(ch)
    if err:
        return [*_run_line(meta), "", f"Chaos soak: {err}"]
    faults, inv = ch["faults"], ch["invariants"]
    fb = inv["feedback"]
    lines = [*_run_line(meta), "",
             f"Chaos soak: seed {ch['seed']}, {ch['minutes']:g} minutes of load, {faults['total']} faults, the "
             f"server on {ch.get('topology', 'one host')}. Verdict: "
             + ("**met**" if ch["met"] else "**missed**: " + ", ".join(k for k, ok in ch["checks"].items() if not ok))
             + f". Feedback acknowledged: {fb['acknowledged']} ({fb['of_deleted_experiments']} to experiments deleted "
             f"later), answers lost to a fault: {fb['unknown']}, groups trained: {fb['trained']}, passed over: "
             + (", ".join(f"{n} {why}" for why, n in sorted(fb["passed_over"].items())) or "none")
             + f"; Tinker models: {inv['tinker_steps']['models']}; experiments created and deleted: "
             f"{ch['experiments_churned']}.", "",
             "| invariant | breaks |", "|---|---|"]
    lines += [f"| {what} (`{name}`) | {inv[name]['count'] if name in inv else 'not checked'} |"
              for name, what in INVARIANTS.items()]
    lines += ["", "| fault | injected | recovery p50 / p95 (s) | errors |", "|---|---|---|---|"]
    for kind, f in faults["by_kind"].items():
        lines.append(f"| {kind} | {f['count']} | {_f(f['recovery_p50_s'], 1)} / {_f(f['recovery_p95_s'], 1)} | "
                     f"{len(f['errors'])} |")
    for kind, why in faults["not_injected"].items():
        lines.append(f"| {kind} | not injected: {why} | | |")
    tp, rss, disk = ch["throughput_groups_per_min"], ch["front_end_rss_mib"], ch["run_dir_mib"]
    lines += ["", f"Acknowledged groups a minute: {_f(tp['during_faults'], 1)} during faults (injection to "
              f"recovery), {_f(tp['outside_faults'], 1)} outside them. Front end RSS after warm-up "
              f"{_f(rss['after_warm_up'], 0)} MiB, peak {_f(rss['peak_after_warm_up'], 0)}, end {_f(rss['end'], 0)}; "
              f"run directory peak {_f(disk['peak'], 0)} MiB (a full disk's ballast included), end "
              f"{_f(disk['end'], 0)} MiB.", "",
              "| family | answers |", "|---|---|"]
    for family, answers in ch["requests"].items():
        lines.append(f"| {family} | " + ", ".join(f"{k}: {v}" for k, v in answers.items()) + " |")
    return lines
