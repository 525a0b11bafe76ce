"""The tenants figure's block of BENCHMARKS.md (scripts/benchmarks/tenants.py; table.py's `render_extra` writes it):
its run line, one row per level of registered experiments and one for `vllm serve`, the checks and the verdict."""

from __future__ import annotations

from .table_cells import _error, _f, _run_line


def _tenants_target(tn: dict) -> str:
    t = tn["targets"]
    return (f"tok/s at the largest A >= {t['tok_s_ratio']:g}x at A = {t['baseline_active']}; each tenant's p95 <= "
            f"{t['p95_spread']:g}x the median tenant's; cold first completion <= warm + {t['cold_extra_s']:g} s; "
            f"learner and sampler RSS at the largest R <= {t['rss_ratio']:g}x the level before (same A); >= "
            f"{t['vs_vllm']:g}x `vllm serve`'s tok/s; 0 errors")


def _tenants_verdict(tn: dict) -> str:
    v, checks = tn["values"], tn["checks"]
    labels = {"tok_s": f"tok/s {_f(v.get('tok_s_ratio'))}x",
              "p95_spread": f"p95 spread {_f(v.get('p95_spread_max'))}x",
              "cold": f"cold +{_f(v.get('cold_extra_s_max'))} s",
              "memory": f"RSS learner {_f(v.get('learner_rss_ratio'))}x, sampler {_f(v.get('sampler_rss_ratio'))}x",
              "vs_vllm": f"vs vllm serve {_f(v.get('vs_vllm'))}x", "errors": f"errors {v.get('errors')}"}
    missed = [labels.get(k, k) for k, ok in checks.items() if ok is False]
    unmeasured = [k for k, ok in checks.items() if ok is None]
    verdict = f"**missed**: {'; '.join(missed)}" if missed else "met" if not unmeasured else "not decided"
    return verdict + (f" (not measured: {', '.join(unmeasured)})" if unmeasured else "")


def _tenants_row(tn: dict) -> tuple[str, str, str, str, str]:
    """The lead of the tenants block (and its row when the figure failed)."""
    name = "many tenants"
    err = _error(tn)
    if err:
        return (name, "active experiments out of many registered on one server, and `vllm serve` with their "
                      "adapters", err, "tok/s, p95 spread, cold start, memory, >= 2x vllm serve, 0 errors", "")
    srv, anchor = tn["server"], tn["anchor"]
    smp, lrn = srv["sampler"], srv.get("learner", {})
    what = (f"completion tok/s and latency of A active experiments out of R registered on one server "
            f"({srv['config']}, max_experiments {srv['max_experiments']}; sampler max_loras {smp['max_loras']}, "
            f"max_cpu_loras {smp['max_cpu_loras']}; learner resident_experiments "
            f"{lrn.get('resident_experiments', 'default')}), R reached by creating more on the running server: "
            f"each active tenant's client (its own key) loops a completion (n={tn['n']}, max_tokens "
            f"{tn['max_tokens']}, a chat prompt of its own; a 429 waited out, its wait counted in the latency) and "
            f"feedback with {tn['n']} distinct rewards (batch_groups {tn['batch_groups']}: a learner step and a push "
            f"per group), for {tn['window_s']:g} s a level; the active set rotates to experiments idle before; then "
            f"{tn['cold_probes']} of the longest idle experiments each get a first completion (cold) and a second "
            f"(warm). Anchor: `vllm serve --enable-lora` with the last level's A adapters (newest versions; "
            f"`--max-loras {anchor.get('max_loras', smp['max_loras'])} --max-cpu-loras "
            f"{anchor.get('max_cpu_loras', smp['max_cpu_loras'])}`, the sampler's engine settings), the same load "
            f"on `/v1/completions`")
    v = tn["values"]
    measured = (f"tok/s at the last level over A = {tn['targets']['baseline_active']}: **{_f(v.get('tok_s_ratio'))}**;"
                f" worst p95 over the median tenant's, largest: **{_f(v.get('p95_spread_max'))}x**; cold - warm, "
                f"largest: **{_f(v.get('cold_extra_s_max'))} s**; RSS, the largest R over the level before: learner "
                f"**{_f(v.get('learner_rss_ratio'))}x**, sampler **{_f(v.get('sampler_rss_ratio'))}x**; over "
                f"`vllm serve`: **{_f(v.get('vs_vllm'))}x**; errors **{v.get('errors')}**")
    return (name, what, measured, _tenants_target(tn), _tenants_verdict(tn))


def _tenants_run_line(meta: dict, tn: dict) -> list[str]:
    """The run line, and how the figure's server differed from configs/server.yaml."""
    changed = tn.get("server", {}).get("changed", {})
    extra = tn.get("server", {}).get("config", "configs/server.yaml")
    notes = []
    if "max_experiments" in changed:
        notes.append(f"max_experiments raised from {changed['max_experiments']['from']} to "
                     f"{changed['max_experiments']['to']} for this figure")
    if "sampler" in changed:
        notes.append("sampler " + ", ".join(f"{k}={v}" for k, v in changed["sampler"].items()))
    notes.append("no experiment tracker")
    line = _run_line(meta)
    return [line[0] + f" The tenants figure's server: {extra}, {'; '.join(notes)}."]


_TENANT_ERRORS = {"non_2xx": "non-2xx", "failed_verifications": "failed push checks", "status_errors": "status errors",
                  "not_active": "not active"}


def _tenants_table(tn: dict) -> list[str]:
    """One row per level of registered experiments, and `vllm serve`'s row."""
    _, what, _, target, verdict = _tenants_row(tn)
    lines = [f"{what}. Target: {target}. Verdict: {verdict}.", "",
             "| registered | active | completion tok/s | latency p50 / p95 (s), median tenant | worst tenant's p95 "
             "(s) | first completion cold / warm (s) | push (s) | learner step (s) | page-ins: count, median (s) | "
             "RSS front end / sampler / learner (MiB) | disk per experiment, median / max (MiB) | learner memory: "
             "resident / paged out | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for lv in tn["levels"]:
        cold = lv.get("cold")
        rss, disk, mem, err = lv["rss_mib"], lv["disk_mib"], lv["learner_memory"], lv["errors"]
        errors = str(lv["error_count"]) if not lv["error_count"] else (
            f"**{lv['error_count']}** (" + ", ".join(f"{_TENANT_ERRORS.get(k, k)} {n}" for k, n in err.items() if n)
            + ")")
        lines.append(
            f"| {lv['registered']} | {lv['active']} | {_f(lv['tok_s'], 1)} | {_f(lv['p50_s_median_tenant'])} / "
            f"{_f(lv['p95_s_median_tenant'])} | {_f(lv['p95_s_worst_tenant'])} | "
            + (f"{_f(cold['cold_median_s'])} / {_f(cold['warm_median_s'])} (+{_f(cold['extra_s'])})" if cold else "-")
            + f" | {_f(lv['push_s_median'])} | {_f(lv['step_s_median'])} | {lv['page_ins']}, "
            f"{_f(lv['page_in_median_s'])} | {_f(rss.get('front_end'), 0)} / {_f(rss.get('sampler'), 0)} / "
            f"{_f(rss.get('learner'), 0)} | {_f(disk['median'], 1)} / {_f(disk['max'], 1)} | "
            f"{mem.get('resident', 0)} / {mem.get('paged_out', 0)} | {errors} |")
    an = tn["anchor"]
    if "skipped" in an:
        lines.append(f"| `vllm serve` | - | {an['skipped']} | | | | | | | | | | |")
    elif "error" in an:
        lines.append(f"| `vllm serve` | {an.get('active', '-')} | failed: {an['error']} | | | | | | | | | | |")
    else:
        fails = an["failures"]
        lines.append(
            f"| `vllm serve` ({an['adapters']} adapters) | {an['active']} | {_f(an['tok_s'], 1)} | "
            f"{_f(an['p50_s_median_tenant'])} / {_f(an['p95_s_median_tenant'])} | {_f(an['p95_s_worst_tenant'])} | - | "
            f"- | - | - | - / {_f(an.get('rss_mib'), 0)} / - | - | - | "
            + (f"**{fails}** ({', '.join(f'{k} {n}' for k, n in an['errors'].items())})" if fails else "0") + " |")
    v = tn["values"]
    levels = tn["levels"]
    base = next((lv for lv in levels if lv["active"] == tn["targets"]["baseline_active"]), None)
    last = levels[-1] if levels else None
    parts = []
    if base and last:
        parts.append(f"tok/s at R={last['registered']} (A={last['active']}) over R={base['registered']} "
                     f"(A={base['active']}): **{_f(v.get('tok_s_ratio'))}**")
    parts.append(f"the worst tenant's p95 over the median tenant's, largest of the levels: "
                 f"**{_f(v.get('p95_spread_max'))}x**")
    parts.append(f"cold - warm first completion, largest: **{_f(v.get('cold_extra_s_max'))} s**")
    if len(levels) >= 2:
        parts.append(f"RSS at R={levels[-1]['registered']} over R={levels[-2]['registered']}"
                     + ("" if v.get("rss_same_active") else " (not the same A)")
                     + f": learner **{_f(v.get('learner_rss_ratio'))}x**, sampler "
                     f"**{_f(v.get('sampler_rss_ratio'))}x**")
    parts.append(f"this server over `vllm serve`: **{_f(v.get('vs_vllm'))}x**")
    parts.append(f"errors **{v.get('errors')}**")
    notes = "; ".join(
        f"R={lv['registered']}: {lv['created']} created ({_f(lv['creation_s']['median'])} s each), "
        f"{lv['newly_active']} of the active never active before, {lv['answers_429']} 429s waited out, "
        f"{lv['learner_steps']} learner steps, {lv['pushes']} pushes"
        + (f" ({lv['inconclusive_verifications']} push checks inconclusive)" if lv.get("inconclusive_verifications")
           else "")
        + f", {lv['page_outs']} page-outs ({_f(lv['page_out_median_s'])} s)" for lv in levels)
    lines += ["", "; ".join(parts) + f". Verdict: {verdict}.", "", f"Per level: {notes}."]
    return lines
