"""scripts/bench: the module imports, and its table writer replaces only the marked block of BENCHMARKS.md.
No timing here: the figures belong to the benchmark."""

from __future__ import annotations

import importlib


def _load(name: str):
    return importlib.import_module(f"scripts.benchmarks.{name}")  # __main__: the driver (scripts/bench)


def _results(**figures) -> dict:
    meta = {"mode": "quick", "date": "2026-01-01 00:00 UTC", "host": "box", "command": "scripts/bench --quick",
            "runtime_s": 300.0, "cpus": 2, "mem_gib": 24.0, "model": "smollm2-135m-instruct", "versions": "torch x",
            "load_note": "front_end 1.0 / 2.0", "others": "", "out": "runs/bench.json"}
    return {"meta": meta, "figures": figures}


def test_bench_imports_and_modes():
    bench = _load("__main__")
    assert bench.QUICK.name == "quick" and bench.FULL.name == "full"
    assert 8 in bench.FULL.levels and 8 not in bench.QUICK.levels
    assert set(bench.FIGURES) == {"front_end", "overlap", "adapter", "push", "learner", "experiments", "memory",
                                  "end_to_end", "episodes"}
    assert "episodes" in _load("server").SERVER_FIGURES and _load("episodes").EXPERIMENT
    assert bench.FULL.end_to_end and not bench.QUICK.end_to_end  # the race runs in full mode only


def test_table_replaces_only_the_marked_block():
    table = _load("table")
    doc = "# Benchmarks\n\nMachine: a box.\nMore of it.\n\n## Old section\n\nkept\n"
    first = table.replace_block(doc, table.render(_results(front_end={"error": "boom"})))
    assert first.startswith("# Benchmarks\n\nMachine: a box.\nMore of it.\n\n" + table.START)
    assert first.count(table.START) == 1 and "## Old section\n\nkept\n" in first
    assert "failed: boom" in first and "| adapter sampling |" in first

    fe = {"requests": 4, "n": 4, "max_tokens": 16, "concurrency": 4, "rounds": 2, "server_tok_s": 10.0,
          "direct_tok_s": 11.0, "ratio": 0.909, "round_ratios": [0.9, 0.92]}
    ov = {"requests": 4, "n": 4, "max_tokens": 16, "concurrency": 4, "rounds": 2, "idle_tok_s": 40.0,
          "busy_tok_s": 20.0, "ratio": 0.5, "train_steps_during_busy": 3}
    second = table.replace_block(first, table.render(_results(front_end=fe, overlap=ov)))
    assert "| overlap |" in second and "20.0 vs 40.0 tok/s: **0.50** (3 train steps meanwhile)" in second
    assert second.count(table.START) == 1 and second.count(table.END) == 1
    assert "failed: boom" not in second and "**0.909**" in second and "missed" in second
    assert second.split(table.START)[0] == first.split(table.START)[0]
    assert second.split(table.END)[1] == first.split(table.END)[1]


def test_table_episodes_row():
    table = _load("table")
    turns = [{"turn": 1, "prompt_tokens": 1200}]
    ep = {"episodes": 32, "turns": 3, "max_tokens": 16, "rounds": 2, "openai_eps": 1.8, "native_eps": 2.0,
          "ratio": 0.9, "round_ratios": [0.88, 0.92],
          "later_turns": {"openai": {"hit_rate": 0.0, "reusable_share": 0.8}},
          "long_history": {"episodes": 8, "notes": 20, "turns": turns,
                           "later_turns": {"hit_rate": 0.7, "reusable_share": 0.9}},
          "feedback": {"groups_rated": 8}}
    row = next(line for line in table.render(_results(episodes=ep)).splitlines() if line.startswith("| episodes |"))
    assert "1.80 vs 2.00 episodes/s: **0.900**" in row and "150-token first prompt 0.700" in row
    assert row.endswith("| >= 0.9 | met |") and "8 groups of episodes rated" in row
    assert "failed: boom" in table.render(_results(episodes={"error": "boom"}))


def _e2e(server: dict, trl: dict, **extra) -> dict:
    experiment = {"lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]},
                  "algorithm": {"loss": "grpo", "learning_rate": 5e-4, "beta": 0.0, "clip_low": 0.2, "clip_high": 0.28,
                                "batch_groups": 2},
                  "sampling": {"n": 8, "temperature": 0.8, "top_p": 1.0, "max_tokens": 40}}
    return {"target": 0.35, "window": 16, "time_limit_s": 1500.0, "experiment": experiment,
            "server": {"concurrency": 4, **server}, "trl": {"versions": {"trl": "1.16.0"}, **trl}, **extra}


def _reached(seconds: float, groups: int, step: int) -> dict:
    return {"reached": True, "reached_s": seconds, "reached_groups": groups, "reached_step": step,
            "best_running_mean": 0.36, "groups": groups, "last_step": step, "load_start": 2.0, "load_end": 3.0}


def _row(table, e2e) -> str:
    rendered = table.render(_results(end_to_end=e2e))
    return next(line for line in rendered.splitlines() if line.startswith("| end to end |"))


def test_table_end_to_end_row():
    table = _load("table")
    skipped = {"skipped": "not run in quick mode (takes up to ~55 minutes): scripts/bench --only end_to_end"}
    row = _row(table, skipped)
    assert "not run in quick mode" in row and "scripts/bench --only end_to_end" in row and ">= 2x faster" in row
    assert "| end to end | " in table.render(_results())  # not asked for: a row that says so
    assert "failed: boom" in _row(table, {"error": "boom"})

    both = _row(table, _e2e(_reached(300.0, 40, 12), _reached(900.0, 36, 18), speedup=3.0))
    assert "**0.35**" in both and "server **300 s**" in both and "TRL **900 s**" in both
    assert "**3.00x**" in both and both.endswith("| >= 2x faster | met |")
    slower = _row(table, _e2e(_reached(600.0, 40, 12), _reached(450.0, 36, 18), speedup=0.75))
    assert "**0.75x**" in slower and "**missed**: 0.75 is 38% of 2.0" in slower

    trl_missed = {"reached": False, "reached_s": None, "best_running_mean": 0.3, "groups": 90, "last_step": 45,
                  "load_start": 2.0, "load_end": 2.5}
    row = _row(table, _e2e(_reached(500.0, 40, 12), trl_missed, speedup=None, common_level=0.3,
                           server_s_at_common=400.0, trl_s_at_common=1400.0, ratio_at_common=3.5))
    assert "TRL did not reach it in 1500 s (best running mean 0.300" in row
    assert "highest mean both reached (0.300): server 400 s vs TRL 1400 s = **3.50x**" in row
    assert "met: more than 3.0x (TRL stopped at its limit)" in row
    server_missed = {**trl_missed, "best_running_mean": 0.32}
    row = _row(table, _e2e(server_missed, _reached(800.0, 36, 18), speedup=None, common_level=0.32,
                           server_s_at_common=1450.0, trl_s_at_common=700.0, ratio_at_common=0.483))
    assert "server did not reach it in 1500 s" in row and "**0.48x**" in row and "**missed**" in row


def test_end_to_end_race_window():
    """The race both sides share: the mean of the last `window` groups, only once there are that many."""
    e2e = _load("race")
    race = e2e.Race(target=0.5, window=3, time_limit_s=3600)
    race.start()
    assert not race.add(1.0, 0) and not race.add(1.0, 0)  # a lucky start is not the running mean yet
    assert race.add(0.0, 1)  # (1 + 1 + 0) / 3 = 0.67 >= 0.5: reached, hence done
    assert race.done and race.reached["groups"] == 3 and race.reached["step"] == 1
    race = e2e.Race(target=0.5, window=3, time_limit_s=3600)
    for reward, step in [(0.1, 0), (0.2, 0), (0.3, 1), (0.9, 1), (0.6, 2)]:
        race.add(reward, step)
    summary = race.summary()
    assert summary["reached"] and summary["reached_groups"] == 5 and summary["reached_step"] == 2
    assert summary["best_running_mean"] == 0.6 and summary["first_window_mean"] == 0.2
    curve = [[1.0, 0, 0.1], [2.0, 0, 0.2], [3.0, 1, 0.3], [4.0, 1, 0.9], [5.0, 2, 0.6]]
    assert e2e.first_time_at(curve, 3, 0.45) == 4.0 and e2e.first_time_at(curve, 3, 0.7) is None
    timed = e2e.Race(target=0.9, window=2, time_limit_s=0.0)
    timed.start()
    assert timed.add(0.1, 0) and timed.summary()["timed_out"]
    server = {**summary}
    trl = {**e2e.Race(0.5, 3, 1).summary(), "best_running_mean": 0.3,
           "curve": [[1.0, 0, 0.3], [2.0, 0, 0.3], [8.0, 1, 0.3]]}
    out = e2e.compare(server, trl, 3)
    assert out["speedup"] is None and out["common_level"] == 0.3 and out["trl_s_at_common"] == 8.0


def test_end_to_end_over_runs():
    """Several pairs: the median time to each level per side, a run that never got there counted as slower
    than every run that did, and the row built from that summary."""
    race, table = _load("race"), _load("table")

    def side(times_to_one: float | None) -> dict:  # a window-2 curve that jumps to 1.0 at `times_to_one`
        at = times_to_one or 999.0
        return {"curve": [[1.0, 0, 0.0], [2.0, 0, 0.0]] + ([[at, 1, 1.0], [at + 1, 1, 1.0]] if times_to_one else [])}

    runs = [{"server": side(10.0), "trl": side(40.0)}, {"server": side(30.0), "trl": side(50.0)},
            {"server": side(20.0), "trl": side(None)}]
    summary = race.summarize_runs(runs, window=2, levels=(0.35, 0.6))
    # the running mean of 2 first reaches 0.5 (>= 0.35) at the first 1.0 and 1.0 (>= 0.6) one group later
    assert summary["0.35"]["server"]["seconds"] == [10.0, 30.0, 20.0]
    server, trl = summary["0.60"]["server"], summary["0.60"]["trl"]
    assert server["median_s"] == 21.0 and (server["min_s"], server["max_s"], server["reached"]) == (11.0, 31.0, 3)
    assert trl["seconds"] == [41.0, 51.0, None] and trl["reached"] == 2 and trl["median_s"] == 51.0
    assert summary["0.60"]["median_speedup"] == round(51.0 / 21.0, 3)
    runs[0]["trl"] = side(None)  # most TRL runs miss: no median, and no ratio of medians
    summary = race.summarize_runs(runs, window=2, levels=(0.6,))
    assert summary["0.60"]["trl"]["median_s"] is None and summary["0.60"]["median_speedup"] is None

    e2e = _e2e({}, {}, runs=[{"server": {"concurrency": 4}, "trl": {"versions": {"trl": "1.16.0"}}}] * 3,
               summary=race.summarize_runs(runs, 2, (0.35, 0.6)), target=0.6, time_limit_s=1800.0)
    row = _row(table, e2e)
    assert "0.60: server median **21 s** (11-31 s, 3 of 3 runs) vs TRL median not reached (1 of 3" in row
    assert "met: more than 85.7x (most TRL runs stopped at the limit)" in row
    e2e["summary"]["0.60"]["server"]["reached"] = 2
    assert "**missed**: the server reached 0.6 in 2 of 3 runs" in _row(table, e2e)


def test_verdicts_judge_the_default_path():
    """The learner with its default checkpoints, the push through the front end (the checkpoint's part of the step
    included) and LoRA sampling on the grouped ops carry the verdicts; the faster variants get rows of their own,
    without one."""
    table = _load("table")
    le = {"sequences": 16, "group_size": 8, "max_completion": 32, "steps": 5, "block": 2, "micro_batch_size": 16,
          "learner_step_s": [1.2] * 5, "plain_step_s": [0.95] * 5, "learner_no_checkpoint_step_s": [1.0] * 5,
          "learner_tok_s": 100.0, "learner_with_checkpoint_tok_s": 83.3, "plain_tok_s": 105.0, "ratio": 0.952,
          "ratio_with_checkpoint": 0.794, "checkpoint_in_step_median_s": 0.2, "ratio_fastest_steps": 0.95,
          "padding": {"padded_tokens": 10, "real_tokens": 100, "padded_over_real": 0.1, "micro_batches": 1}}
    push = {"direct": {"rounds": 5, "probe_tokens": 8, "median_s": {"push_total": 0.9, "save_adapter": 0.1,
                                                                     "load_adapter": 0.05, "first_completion": 0.75,
                                                                     "verification": 1.5}},
            "server": {"rounds": [{"first_completion_answered_after_push_start_s": x} for x in (1.1, 1.2, 1.0)],
                       "median_s": {"push_s": 0.3, "first_completion_answered_after_push_start_s": 1.1}}}
    ad = {"requests": 2, "n": 8, "max_tokens": 32, "results": [
        {"dtype": "float32", "passes": 5, "base_tok_s": 100.0, "lora_tok_s": 37.0, "ratio": 0.37,
         "grouped_lora_tok_s": 75.0, "grouped_ratio": 0.75, "served_tok_s": 104.0, "served_ratio": 1.04}]}
    rows = {line.split(" | ")[0][2:]: line for line in table.render(_results(learner=le, push=push, adapter=ad))
            .splitlines() if line.startswith("| ")}
    assert "**0.794**" in rows["learner"] and "**missed**: 0.79" in rows["learner"]
    assert "a checkpoint after every step" in rows["learner"]  # a result from before checkpoint_interval_s
    le.update(checkpoint_interval_s=30.0, checkpoints_written=2)
    rows = {line.split(" | ")[0][2:]: line for line in table.render(_results(learner=le, push=push, adapter=ad))
            .splitlines() if line.startswith("| ")}
    assert "a checkpoint after the first step 30 s after the last one started (2 in its 10 timed steps)" in rows[
        "learner"]
    assert rows["learner, no checkpoint (variant)"].endswith("| report |  |") and "**0.952**" in rows[
        "learner, no checkpoint (variant)"]
    assert "**1.30 s**" in rows["weight push"] and "**missed**" in rows["weight push"]  # 0.2 + 1.1 > 1 s
    assert rows["weight push, worker verbs (variant)"].endswith("| report |  |")
    assert "**0.75**" in rows["adapter sampling"] and "**missed**" in rows["adapter sampling"]
    assert "**1.04**" in rows["adapter sampling, one experiment alone (variant)"]
    assert "median of 5 timed passes" in rows["adapter sampling"]


def test_an_extra_figure_writes_a_block_of_its_own():
    """A run of rollouts (or hostile, fairness) alone rewrites its own block and leaves the summary as it was; the
    rollouts block is a table with one row per number of episodes in flight."""
    table = _load("table")
    side = {"eps": 2.0, "tok_s": 50.0, "p50_s": 0.5, "p95_s": 1.0, "non_2xx": {}, "failures_5xx": 0,
            "failed_episodes": 0, "tool_calls": 1, "front_end_rss_mib": 600.0, "loop_lag_p99_s": 0.002,
            "prefix_cache_hit_rate_later_turns": 0.8, "answers_429": 0}
    levels = [{"level": k, "A": side, "B": {**side, "eps": eps_b, "p95_s": 0.9}, "eps_ratio": 2.0 / eps_b,
               "p95_ratio": 1.0 / 0.9} for k, eps_b in ((16, 2.0), (64, 2.5))]
    ro = {"levels": levels, "target_eps_ratio": 0.95, "target_p95_ratio": 1.2, "turns": 3, "temperature": 1.0,
          "turn_max_tokens": [40, 16, 16], "tool": "get_weather", "lora_rank": 8, "served_as": "merged",
          "tool_parser": "hermes", "rounds": 2, "idle_cpu": {"A": 0.02, "B": 0.01}}
    doc = table.replace_block("# Benchmarks\n\nMachine: a box.\n", table.render(_results(front_end={"error": "x"})))
    once = table.replace_block(doc, table.render_extra(_results(rollouts=ro), "rollouts"), "rollouts")
    start, end = table.markers("rollouts")
    assert once.startswith(doc.rstrip("\n")) and once.count(start) == 1 and once.rstrip().endswith(end)
    block = once.split(start)[1]
    assert "| 16 | 2.00 vs 2.00 | **1.000** |" in block and "| 64 | 2.00 vs 2.50 | **0.800** |" in block
    assert "**missed**: episodes/s 0.80" in block  # the 64 row, by its own ratio
    again = table.replace_block(once, table.render_extra(_results(rollouts={"error": "boom"}), "rollouts"), "rollouts")
    assert again.split(start)[0] == once.split(start)[0] and "failed: boom" in again and "| 64 |" not in again


def test_the_hostile_row_judges_every_target():
    """The hostile tenant's verdict names each target missed: the victim's ratios, the front end's RSS growth, the
    event-loop lag during the flood and a 202 not trained; and says what the special-token streams held."""
    table = _load("table")
    lat = {"median_s": 0.5, "p90_s": 0.6}
    ho = {"ratio_completion_median": 1.4, "ratio_feedback_median": 1.2, "every_202_trained": True, "target": 2.0,
          "target_rss_mib": 200.0, "target_lag_s": 0.25, "requests": 20, "n": 4, "max_tokens": 8, "batch_groups": 2,
          "front_end_rss": {"before_mib": 600.0, "peak_mib": 700.0, "growth_mib": 100.0},
          "loop_lag": {"alone_max_s": 0.01, "flood_max_s": 0.05},
          "checks": {"completion": True, "feedback": True, "rss": True, "loop_lag": True, "every_202_trained": True},
          "victim": {"alone": {"completion": lat, "feedback": lat}, "flooded": {"completion": lat, "feedback": lat},
                     "counters": {"groups_trained": 30}},
          "hostile": {"threads_per_kind": 4, "answers": {"csr over_limit": 3, "names 422 invalid_request": 9},
                      "threads": {"asample64": 20, "csr": 2, "decode": 10, "names": 2, "stream": 2},
                      "name_chars": 10240, "streams": {"streams": 2, "tokens": 100, "special_share": 1.0,
                                                       "text_chars": 0, "n": 64, "max_tokens": 256}}}

    def row(fig: dict) -> str:
        return next(line for line in table.render_extra(_results(hostile=fig), "hostile").splitlines()
                    if line.startswith("| hostile tenant |"))
    met = row(ho)
    assert met.endswith("| met |") and "**+100 MiB**" in met and "**0.050 s**" in met and "10 KB name" in met
    assert "csr over_limit 3" in met and "1.00 of them the special token" in met
    bad = {**ho, "front_end_rss": {**ho["front_end_rss"], "growth_mib": 3400.0}, "loop_lag": {"flood_max_s": 8.0},
           "checks": {**ho["checks"], "rss": False, "loop_lag": False}}
    assert "**missed**: RSS +3400 MiB; loop lag 8.00 s |" in row(bad)
    starved = {**ho, "ratio_completion_median": 240.0, "ratio_feedback_median": None,
               "checks": {**ho["checks"], "completion": False, "feedback": False},
               "victim": {**ho["victim"], "flooded": {"completion": {"median_s": 120.0, "count": 2}, "feedback": None,
                                                      "errors": {"503 worker_timeout": 2}}}}
    line = row(starved)
    assert "503 worker_timeout x2" in line and "-> n/a s" in line
    assert line.endswith("| **missed**: completion 240.00x and 2 victim 5xx; feedback n/ax |")
    # A figure of the first round (no RSS, lag or checks) is still judged on its ratios.
    old = {k: v for k, v in ho.items() if k not in ("front_end_rss", "loop_lag", "checks")}
    old["hostile"] = {"threads_per_kind": 4, "answers": {"train ok": 8}}
    assert row({**old, "ratio_feedback_median": 2.5}).endswith("| **missed**: feedback 2.50x |")


def _tenants_level(registered: int, active: int, tok_s: float, p95: float, worst: float, cold: dict | None,
                   rss: dict, errors: int = 0) -> dict:
    return {"registered": registered, "active": active, "created": registered, "newly_active": active,
            "creation_s": {"median": 1.5, "max": 2.0, "total": 1.5 * registered}, "tok_s": tok_s,
            "p50_s_median_tenant": p95 / 2, "p95_s_median_tenant": p95, "p95_s_worst_tenant": worst,
            "p95_spread": worst / p95, "answers_429": 3, "cold": cold, "push_s_median": 0.4, "pushes": active,
            "step_s_median": 0.9, "learner_steps": 2 * active, "page_ins": 5, "page_in_median_s": 0.3,
            "page_outs": 7, "page_out_median_s": 0.2, "rss_mib": rss, "disk_mib": {"median": 60.0, "max": 180.5},
            "learner_memory": {"resident": min(registered, 32), "paged_out": max(0, registered - 32)},
            "errors": {"non_2xx": errors, "failed_verifications": 0, "too_many_adapters": 0, "not_active": 0},
            "error_count": errors}


def test_the_tenants_block_has_a_row_per_level_and_vllm_serve():
    """The tenants block: one row per level of registered experiments, `vllm serve`'s row, the verdict naming each
    target missed, and the run line saying how the figure's server differed from configs/server.yaml."""
    table = _load("table")
    rss = {"front_end": 580.0, "sampler": 4600.0, "learner": 3100.0}
    cold = {"cold_median_s": 1.2, "warm_median_s": 0.5, "extra_s": 0.7}
    levels = [_tenants_level(1, 1, 90.0, 0.8, 0.8, None, rss), _tenants_level(16, 16, 200.0, 2.0, 3.0, None, rss),
              _tenants_level(64, 32, 210.0, 4.0, 6.0, cold, rss),
              _tenants_level(256, 32, 205.0, 4.2, 7.0, cold, {**rss, "learner": 3200.0})]
    anchor = {"adapters": 32, "active": 32, "tok_s": 80.0, "p50_s_median_tenant": 5.0, "p95_s_median_tenant": 9.0,
              "p95_s_worst_tenant": 11.0, "failures": 0, "errors": {}, "rss_mib": 4000.0, "max_loras": 4,
              "max_cpu_loras": 16}
    checks = {"tok_s": True, "p95_spread": True, "cold": True, "memory": True, "vs_vllm": True, "errors": True}
    values = {"tok_s_ratio": 1.025, "p95_spread_max": 1.667, "cold_extra_s_max": 0.7, "learner_rss_ratio": 1.032,
              "sampler_rss_ratio": 1.0, "rss_same_active": True, "vs_vllm": 2.563, "errors": 0}
    tn = {"met": True, "checks": checks, "values": values, "levels": levels, "anchor": anchor,
          "targets": {"tok_s_ratio": 0.9, "baseline_active": 16, "p95_spread": 2.0, "cold_extra_s": 1.0,
                      "rss_ratio": 1.15, "vs_vllm": 2.0},
          "window_s": 120.0, "n": 4, "max_tokens": 16, "batch_groups": 1, "cold_probes": 4,
          "server": {"config": "configs/server.yaml", "max_experiments": 256,
                     "changed": {"max_experiments": {"from": 64, "to": 256}, "trackers": "none"},
                     "sampler": {"max_loras": 4, "max_cpu_loras": 16}, "learner": {"resident_experiments": 32}}}
    block = table.render_extra(_results(tenants=tn), "tenants")
    rows = [line for line in block.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 4 + 1  # the header, a row per level, vllm serve
    assert "max_experiments raised from 64 to 256 for this figure" in block.splitlines()[0]
    assert rows[1].startswith("| 1 | 1 | 90.0 | 0.40 / 0.80 | 0.80 | - |")
    assert rows[4].startswith("| 256 | 32 | 205.0 | 2.10 / 4.20 | 7.00 | 1.20 / 0.50 (+0.70) | 0.40 | 0.90 | 5, 0.30 |")
    assert "| 580 / 4600 / 3200 | 60.0 / 180.5 | 32 / 224 | 0 |" in rows[4]
    assert rows[5].startswith("| `vllm serve` (32 adapters) | 32 | 80.0 | 5.00 / 9.00 | 11.00 |") and rows[5].endswith(
        "| 0 |")
    assert "tok/s at R=256 (A=32) over R=16 (A=16): **1.02**" in block and "over `vllm serve`: **2.56x**" in block
    assert "Verdict: met." in block and "RSS at R=256 over R=64: learner **1.03x**" in block
    # A target missed is named; errors are broken down in their row; vllm serve that could not start is said so.
    bad = {**tn, "checks": {**checks, "vs_vllm": False, "errors": False}, "values": {**values, "vs_vllm": 1.4,
                                                                                    "errors": 2},
           "levels": levels[:3] + [_tenants_level(256, 32, 205.0, 4.2, 7.0, cold, rss, errors=2)],
           "anchor": {"error": "RuntimeError: vllm serve (tenants) exited with 1", "active": 32}}
    block = table.render_extra(_results(tenants=bad), "tenants")
    assert "Verdict: **missed**: vs vllm serve 1.40x; errors 2." in block
    assert "| **2** (non-2xx 2) |" in block and "| `vllm serve` | 32 | failed: RuntimeError: vllm serve" in block
    unmeasured = {**tn, "checks": {**checks, "tok_s": None}}
    assert "Verdict: not decided (not measured: tok_s)." in table.render_extra(_results(tenants=unmeasured), "tenants")
    assert "failed: boom" in table.render_extra(_results(tenants={"error": "boom"}), "tenants")
    start, end = table.markers("tenants")
    doc = table.replace_block("# Benchmarks\n\nMachine: a box.\n", table.render(_results(front_end={"error": "x"})))
    once = table.replace_block(doc, block, "tenants")
    assert once.count(start) == 1 and once.split(start)[0] == doc.rstrip("\n") + "\n\n"


def test_the_tenants_active_set_rotates_to_idle_experiments():
    """At each level half the active set comes from experiments active before but not at the last level, the rest
    from experiments never active: at 256 registered, 16 that trained at 16 and have been idle since, and 16 new."""
    tenants = _load("tenants")
    registered: list = []
    last: set[str] = set()
    chosen = []
    for index, (count, active) in enumerate(((1, 1), (16, 16), (64, 32), (256, 32))):
        registered += [tenants.Tenant(i, f"tenant-{i:03d}", "key", 0.0) for i in range(len(registered), count)]
        picked = tenants.pick_active(registered, active, last)
        for t in picked:
            t.last_active_level = index
        last = {t.name for t in picked}
        chosen.append([t.index for t in picked])
    assert chosen[0] == [0] and chosen[1] == list(range(16)) and chosen[2] == list(range(16, 48))
    assert chosen[3] == list(range(16)) + list(range(48, 64))
