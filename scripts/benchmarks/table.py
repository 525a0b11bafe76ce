"""The summary table of scripts/bench: one row per figure, rendered from its JSON results, in BENCHMARKS.md.

Written into BENCHMARKS.md between marker comments (a rerun replaces the block; nothing else in the file
changes). The figures run only when named (`EXTRA`: fairness, hostile, rollouts, tenants, chaos) each have a block of
their own
(`<!-- bench:NAME:start -->`, `render_extra`), so a run of one of them leaves the summary's block as it was, and
the summary of a run never drops them. No ML imports."""

from __future__ import annotations

import re

from .table_cells import _error, _f, _run_line, _spread, _verdict
from .table_chaos import chaos_block
from .table_tenants import _tenants_row, _tenants_run_line, _tenants_table

START = "<!-- bench:start -->"
END = "<!-- bench:end -->"
# Figures with a block of their own (run only when named).
EXTRA = ("fairness", "hostile", "rollouts", "tenants", "chaos")


def markers(name: str | None = None) -> tuple[str, str]:
    """The summary's markers, or those of the extra figure `name`."""
    return (START, END) if name is None else (f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->")


def replace_block(text: str, block: str, name: str | None = None) -> str:
    """`text` with the marked block (the summary's, or the extra figure `name`'s) replaced by `block` (markers
    included). Without markers, the summary goes after the paragraph that starts with 'Machine:' (else after the
    first heading), and an extra figure's block at the end."""
    start, end = markers(name)
    block = f"{start}\n{block.strip()}\n{end}"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        return head + block + tail
    if name is not None:
        return text.rstrip("\n") + "\n\n" + block + "\n"
    match = re.search(r"^Machine:.*?(?:\n\s*\n|\Z)", text, flags=re.MULTILINE | re.DOTALL)
    if match is None:
        match = re.search(r"^#.*\n", text, flags=re.MULTILINE)
    at = match.end() if match else 0
    before = text[:at].rstrip("\n") + "\n\n" if text[:at].strip() else ""
    return before + block + "\n\n" + text[at:].lstrip("\n")


def _side(name: str, side: dict, limit: float) -> str:
    load = f"load {_f(side.get('load_start'), 1)} / {_f(side.get('load_end'), 1)}"
    if side.get("reached"):
        return (f"{name} **{_f(side['reached_s'], 0)} s** ({side['reached_groups']} groups, the last sampled after "
                f"{side['reached_step']} optimizer steps; {load})")
    return (f"{name} did not reach it in {limit:g} s (best running mean {_f(side.get('best_running_mean'), 3)}; "
            f"{side.get('groups')} groups, {side.get('last_step')} optimizer steps; {load})")


def _race_what(e2e: dict, server: dict, trl: dict) -> str:
    exp = e2e["experiment"]
    alg, smp, lora = exp["algorithm"], exp["sampling"], exp["lora"]
    return (f"wall time until the mean reward of the last {e2e['window']} groups reaches **{e2e['target']}** on "
            f"alphabetize (configs/alphabetize.yaml: n={smp['n']}, T={smp['temperature']}, max_tokens "
            f"{smp['max_tokens']}, lr {alg['learning_rate']:g}, LoRA r={lora['r']} on {len(lora['target_modules'])} "
            f"modules, loss {alg['loss']}, beta {alg['beta']:g}, clip {alg['clip_low']:g}/{alg['clip_high']:g}, "
            f"{alg['batch_groups']} groups per step): this server (configs/server.yaml; examples/task_runner.py's "
            f"client, {server.get('concurrency')} groups in flight as in scripts/demo) vs TRL "
            f"{trl.get('versions', {}).get('trl', '?')} `GRPOTrainer` (transformers generate, same settings; "
            f"scripts/benchmarks/trl_side.py), one after the other; the clock starts at adapter creation (model "
            f"load and server start excluded on both sides); limit {e2e['time_limit_s']:g} s per side")


def _over_runs(name: str, side: dict) -> str:
    if side["median_s"] is None:
        return f"{name} median not reached ({side['reached']} of {side['runs']} runs reached it)"
    spread = f"{_f(side['min_s'], 0)}-{_f(side['max_s'], 0)} s"
    return f"{name} median **{_f(side['median_s'], 0)} s** ({spread}, {side['reached']} of {side['runs']} runs)"


def _end_to_end_runs_row(e2e: dict) -> tuple[str, str, str, str, str]:
    """Several pairs: per level, each side's median time, its spread and how many runs reached it."""
    name, target = "end to end", f">= 2x faster (median), {e2e['target']} in every server run"
    runs = e2e["runs"]
    what = _race_what(e2e, runs[0]["server"], runs[0]["trl"]) + f"; {len(runs)} pairs, run i with seed i"
    levels = e2e["summary"]
    parts = []
    for level, at in levels.items():
        ratio = f": **{_f(at['median_speedup'], 2)}x**" if at["median_speedup"] is not None else ""
        parts.append(f"{level}: {_over_runs('server', at['server'])} vs {_over_runs('TRL', at['trl'])}{ratio}")
    top = levels[f"{e2e['target']:.2f}"]
    server, speedup = top["server"], top["median_speedup"]
    if server["reached"] < server["runs"]:
        verdict = f"**missed**: the server reached {e2e['target']} in {server['reached']} of {server['runs']} runs"
    elif speedup is not None:
        verdict = _verdict(speedup, 2.0)
    else:  # most TRL runs stopped at the limit: the ratio is at least limit / the server's median
        bound = e2e["time_limit_s"] / server["median_s"]
        verdict = (f"met: more than {bound:.1f}x (most TRL runs stopped at the limit)" if bound >= 2.0 else
                   f"not decided: most TRL runs stopped at the limit, so more than {bound:.1f}x")
    return (name, what, "; ".join(parts), target, verdict)


def _end_to_end_row(e2e: dict | None) -> tuple[str, str, str, str, str]:
    name, target = "end to end", ">= 2x faster"
    brief = "time to a mean reward on alphabetize, this server vs TRL GRPOTrainer"
    if e2e and "skipped" in e2e:
        return (name, brief, e2e["skipped"], target, "")
    err = _error(e2e)
    if err:
        return (name, brief, err, target, "")
    if "runs" in e2e:
        return _end_to_end_runs_row(e2e)
    server, trl = e2e["server"], e2e["trl"]
    what = _race_what(e2e, server, trl)
    measured = f"{_side('server', server, e2e['time_limit_s'])} vs {_side('TRL', trl, e2e['time_limit_s'])}"
    speedup = e2e.get("speedup")
    if speedup is not None:
        return (name, what, f"{measured}: **{_f(speedup, 2)}x**", target, _verdict(speedup, 2.0))
    common = e2e.get("ratio_at_common")
    if common is not None:
        measured += (f"; at the highest mean both reached ({_f(e2e['common_level'], 3)}): server "
                     f"{_f(e2e['server_s_at_common'], 0)} s vs TRL {_f(e2e['trl_s_at_common'], 0)} s = "
                     f"**{_f(common, 2)}x**")
    if server.get("reached") and not trl.get("reached"):
        bound = e2e["time_limit_s"] / server["reached_s"]
        verdict = (f"met: more than {bound:.1f}x (TRL stopped at its limit)" if bound >= 2.0 else
                   f"not decided: TRL stopped at its limit, so more than {bound:.1f}x; raise the limit")
    elif not server.get("reached"):
        verdict = "**missed**: the server did not reach the target"
    else:
        verdict = "not decided"
    return (name, what, measured, target, verdict)


def _episodes_row(ep: dict | None) -> tuple[str, str, str, str, str]:
    name, target = "episodes", ">= 0.9"
    err = _error(ep)
    if err:
        return (name, "agent episodes through the OpenAI endpoint vs the native API", err, target, "")
    later, long = ep["later_turns"]["openai"], ep["long_history"]["later_turns"]
    first_turn = ep["long_history"]["turns"][0]["prompt_tokens"] // ep["long_history"]["episodes"]
    what = (f"episodes/s of {ep['episodes']} concurrent {ep['turns']}-turn agent episodes (each turn n=1, max_tokens "
            f"{ep['max_tokens']}; turn k+1 = the history + the reply + a user message) through "
            f"`POST /v1/chat/completions` with `openai.AsyncOpenAI` (`extra_body` episode_id) vs "
            f"`AsyncClient.complete(..., episode_id=...)`; {ep['rounds']} rounds each, alternating, medians; "
            f"the sampler's prefix-cache hits (vLLM `num_cached_tokens`) of turns 2-{ep['turns']}")
    measured = (f"{_f(ep['openai_eps'], 2)} vs {_f(ep['native_eps'], 2)} episodes/s: **{_f(ep['ratio'], 3)}** "
                f"(per round {', '.join(_f(r, 2) for r in ep['round_ratios'])}). Prefix-cache hit rate of later "
                f"turns: **{_f(later['hit_rate'], 3)}** (the previous turn's ids are {_f(later['reusable_share'], 2)} "
                f"of their prompts); with a {first_turn}-token first prompt "
                f"{_f(long['hit_rate'], 3)} (reusable {_f(long['reusable_share'], 2)}). "
                f"{ep['feedback']['groups_rated']} groups of episodes rated (random rewards)")
    return (name, what, measured, target, _verdict(ep["ratio"], 0.9) + _spread(ep["round_ratios"]))


def _fairness_row(fa: dict) -> tuple[str, str, str, str, str]:
    name, target = "fairness", "<= 2x; noisy learns (>= 1 step in the window)"
    err = _error(fa)
    if err:
        return (name, "a quiet experiment's latency alone vs beside a noisy one's flood", err, target, "")
    noisy, lag = fa["noisy"], fa["loop_lag"]
    steps = noisy["learner_steps_window"]
    what = (f"`quiet`'s completion latency ({fa['requests']}+ requests one after another, n={fa['n']}, max_tokens "
            f"{fa['max_tokens']}) alone vs while `noisy` is flooded by {fa['noisy_clients']} clients looping "
            f"completion + feedback (batch_groups {fa['batch_groups']}, its learner stepping), on a server of its own; "
            f"and `noisy`'s learner steps meanwhile")
    measured = (f"median {_f(fa['alone']['median_s'], 3)} s alone, {_f(fa['flooded']['median_s'], 3)} s flooded: "
                f"**{_f(fa['ratio_median'], 2)}x** (p90 {_f(fa['ratio_p90'], 2)}x; alone again after "
                f"{_f(fa['alone_after']['median_s'], 3)} s). noisy in the {noisy['window_s']} s window: "
                f"**{steps} learner steps**; "
                f"{', '.join(f'{k} {v}' for k, v in noisy['answers_window'].items())}. Event-loop lag flooded: p99 "
                f"{_f(lag['flooded']['p99_s'], 3)} s, max {_f(lag['flooded']['max_s'], 3)} s")
    ratio = fa["ratio_median"]
    missed = ([f"{ratio:.2f}x"] if ratio > 2.0 else []) + ([f"noisy made {steps} learner steps"]
                                                          if steps < fa.get("noisy_steps_target", 1) else [])
    return (name, what, measured, target, f"**missed**: {'; '.join(missed)}" if missed else "met")


def _hostile_row(ho: dict) -> tuple[str, str, str, str, str]:
    name = "hostile tenant"
    target = (f"<= {ho.get('target', 2.0):g}x each; front end RSS +< {ho.get('target_rss_mib', 200):g} MiB; "
              f"event_loop_lag_max_s < {ho.get('target_lag_s', 0.25):g} s; every 202 trained")
    err = _error(ho)
    if err:
        return (name, "a tenant's native latency alone vs beside another key's flood of attacks", err, target, "")
    v, h = ho["victim"], ho["hostile"]
    answers, threads = h["answers"], h.get("threads", {})
    what = (f"`victim`'s completion + feedback latency ({ho['requests']}+ rounds one after another, n={ho['n']}, "
            f"max_tokens {ho['max_tokens']}, batch_groups {ho['batch_groups']}) alone vs while another key floods "
            f"Tinker asample with prompt logprobs, forward_backward + optim_step and adapter downloads "
            f"({h['threads_per_kind']} threads each)")
    if threads:  # issue 57's attacks
        st = h.get("streams") or {}
        what += (f", and asample of num_samples {st.get('n', 64)} ({threads.get('asample64')} threads), ~3 KB CSR "
                 f"bodies of 268M dense values ({threads.get('csr')}), ~6 MiB protobuf forward_backward bodies "
                 f"({threads.get('decode')}), sampler saves with a {h.get('name_chars', 10240) // 1024} KB name "
                 f"({threads.get('names')}) and chat streams of n={st.get('n', 64)}, max_tokens "
                 f"{st.get('max_tokens')} from weights trained to emit a special token ({threads.get('stream')})")
    what += "; on a server of its own"
    rss, lag = ho.get("front_end_rss") or {}, ho.get("loop_lag") or {}
    measured = (f"completion median {_f(v['alone']['completion']['median_s'], 3)} -> "
                f"{_f(v['flooded']['completion']['median_s'], 3)} s: **{_f(ho['ratio_completion_median'], 2)}x**; "
                f"feedback {_f(v['alone']['feedback']['median_s'], 4)} -> "
                f"{_f((v['flooded']['feedback'] or {}).get('median_s'), 4)} s: "
                f"**{_f(ho['ratio_feedback_median'], 2)}x**; ")
    errors = v["flooded"].get("errors") or {}
    if errors:
        measured += ("the victim's completions answered " + ", ".join(f"{k} x{n}" for k, n in errors.items())
                     + " (each counted at the time it waited); ")
    if rss or lag:
        measured += (f"front end RSS {_f(rss.get('before_mib'), 0)} -> peak {_f(rss.get('peak_mib'), 0)} MiB: "
                     f"**+{_f(rss.get('growth_mib'), 0)} MiB**; event_loop_lag_max_s during the flood "
                     f"**{_f(lag.get('flood_max_s'), 3)} s** (alone {_f(lag.get('alone_max_s'), 3)}); ")
    if rss.get("decode_flood_stopped_at_s") is not None:
        measured += (f"the decode flood stopped {rss['decode_flood_stopped_at_s']:g} s in, past {rss['safety_mib']:g}"
                     " MiB of growth (the safety cap); ")
    measured += (f"victim rounds flooded: {v['flooded']['completion'].get('count', 'n/a')}; every 202 trained: "
                 f"**{ho['every_202_trained']}** ({v['counters']['groups_trained']} trained). "
                 "Hostile calls: " + ", ".join(f"{k} {n}" for k, n in answers.items()))
    st = h.get("streams")
    if st and st.get("streams"):
        measured += (f". Streams: {st['streams']} of {st['tokens']} tokens, {_f(st['special_share'], 2)} of them the "
                     f"special token, {st['text_chars']} characters of text")
    checks = ho.get("checks") or {"completion": ho["ratio_completion_median"] <= ho["target"],
                                  "feedback": ho["ratio_feedback_median"] <= ho["target"],
                                  "every_202_trained": ho["every_202_trained"]}
    labels = {"completion": f"completion {_f(ho['ratio_completion_median'])}x"
                            + (f" and {sum(errors.values())} victim 5xx" if errors else ""),
              "feedback": f"feedback {_f(ho['ratio_feedback_median'])}x",
              "rss": f"RSS +{_f(rss.get('growth_mib'), 0)} MiB",
              "loop_lag": f"loop lag {_f(lag.get('flood_max_s'), 2)} s",
              "every_202_trained": "a 202 not trained"}
    missed = [labels.get(k, k) for k, ok in checks.items() if not ok]
    return (name, what, measured, target, f"**missed**: {'; '.join(missed)}" if missed else "met")


def _rollouts_row(ro: dict) -> tuple[str, str, str, str, str]:
    name = "agent rollouts vs vllm serve"
    err = _error(ro)
    if err:
        return (name, "tool-calling episodes through this server vs `vllm serve`", err, ">= 0.95; p95 <= 1.2x", "")
    target = f">= {ro['target_eps_ratio']:g} episodes/s; p95 <= {ro['target_p95_ratio']:g}x; no 5xx"
    lora, eager = (any(side in lv for lv in ro["levels"]) for side in ("L", "E"))
    what = (f"episodes/s and turn latency of {ro['turns']}-turn agent episodes (n=1, T={ro['temperature']:g}, "
            f"max_tokens {'/'.join(map(str, ro['turn_max_tokens']))}; one `{ro['tool']}` tool offered each turn, a "
            f"`tool` result after a call, else a user message) with `openai.AsyncOpenAI`: this server's "
            f"`/v1/chat/completions` (LoRA r={ro['lora_rank']} experiment, {ro['served_as']}, `episode_id`) vs "
            f"`vllm serve` on the base weights with the sampler's engine settings and `--tool-call-parser "
            f"{ro['tool_parser']}`" + (" (and, without targets, the same with `--enforce-eager`: what torch.compile "
                                       "gains" if eager else "")
            + ("; with the adapter, `--enable-lora`" if lora else "") + (")" if eager else "")
            + f"; k episodes in flight, {ro['rounds']} rounds a side, alternating; on a server of its own")
    parts, missed = [], []
    for lv in ro["levels"]:
        a, b = lv["A"], lv["B"]
        ref = f"; with LoRA {_f(lv['L']['eps'], 2)}" if "L" in lv else ""
        errors = {k: v for k, v in a["non_2xx"].items() if k != "429"}
        parts.append(f"k={lv['level']}: {_f(a['eps'], 2)} vs {_f(b['eps'], 2)} episodes/s **{_f(lv['eps_ratio'], 2)}**"
                     f"{ref}, p95 {_f(a['p95_s'], 2)} vs {_f(b['p95_s'], 2)} s **{_f(lv['p95_ratio'], 2)}x** "
                     f"(p50 {_f(a['p50_s'], 2)} vs {_f(b['p50_s'], 2)}); front end RSS {_f(a['front_end_rss_mib'], 0)} "
                     f"MiB, loop lag p99 {_f(a['loop_lag_p99_s'], 3)} s; later turns' prefix-cache hits "
                     f"{_f(a['prefix_cache_hit_rate_later_turns'], 2)}; 429s {a['answers_429']}"
                     + (f"; errors {errors}" if errors else "")
                     + f"; tool calls {a['tool_calls']} vs {b['tool_calls']}")
        if lv["eps_ratio"] is None or lv["eps_ratio"] < ro["target_eps_ratio"]:
            missed.append(f"k={lv['level']} episodes/s {_f(lv['eps_ratio'], 2)}")
        if lv["p95_ratio"] is None or lv["p95_ratio"] > ro["target_p95_ratio"]:
            missed.append(f"k={lv['level']} p95 {_f(lv['p95_ratio'], 2)}x")
        if a["failures_5xx"] or a["failed_episodes"]:
            missed.append(f"k={lv['level']} {a['failures_5xx']} 5xx, {a['failed_episodes']} episodes failed")
    idle = ", ".join(f"{k} {_f(v, 2)}" for k, v in ro.get("idle_cpu", {}).items())
    measured = "; ".join(parts) + f". Idle CPU (cores): {idle}"
    return (name, what, measured, target, f"**missed**: {'; '.join(missed)}" if missed else "met")


def _rounds(fig: dict) -> str:
    """The request mix and its alternating rounds, as the front-end and overlap figures run them."""
    return (f"{fig['requests']} requests x n={fig['n']}, max_tokens {fig['max_tokens']}, concurrency "
            f"{fig['concurrency']}; {fig['rounds']} rounds each, alternating")


# The rows with a verdict judge the path a user gets by default (issue 28, item 4): LoRA sampling whenever more
# than one experiment samples, the push through the front end after the learner's step and its checkpoint's part
# of it, the learner with its default checkpoints (copied in the step, written beside the next). A faster variant
# gets a row of its own, marked "variant", with no verdict.

def _adapter_rows(ad: dict | None) -> list[tuple[str, str, str, str, str]]:
    err = _error(ad)
    if err:
        return [("adapter sampling", "LoRA vs base", err, ">= 0.8", "")]
    r0 = ad["results"][0]
    extra = "; ".join(f"{r['dtype']}: served {_f(r.get('served_tok_s'), 1)}, grouped LoRA "
                      f"{_f(r.get('grouped_lora_tok_s'), 1)}, base {_f(r['base_tok_s'], 1)}" for r in ad["results"][1:])
    passes = r0.get("passes", 1)
    setup = (f"r=16 adapter on 7 modules vs no adapter, each in a fresh process (scripts/benchmarks/adapter.py; "
             f"{ad['requests']} requests x n={ad['n']}, {ad['max_tokens']} tokens, ignore_eos; the median of "
             f"{passes} timed passes in each process: an engine with LoRA on is not the base, so the sides cannot "
             f"alternate in one)")
    grouped = r0.get("grouped_ratio")
    main = ("adapter sampling", f"tok/s through LoRA on sampler/lora_cpu_ops.py's grouped ops (the default path "
            f"whenever more than one experiment samples) vs the base model; {setup}",
            f"{r0['dtype']}: {_f(r0.get('grouped_lora_tok_s'), 1)} vs {_f(r0['base_tok_s'], 1)} tok/s: "
            f"**{_f(grouped, 2)}**; vLLM's own CPU LoRA ops {_f(r0['lora_tok_s'], 1)}: {_f(r0['ratio'], 2)}"
            + (f" ({extra})" if extra else ""), ">= 0.8", _verdict(grouped, 0.8))
    lone = ("adapter sampling, one experiment alone (variant)",
            "the same, with the adapter as the sampler serves a lone experiment: merged into the weights",
            f"{_f(r0.get('served_tok_s'), 1)} vs {_f(r0['base_tok_s'], 1)} tok/s: **{_f(r0.get('served_ratio'), 2)}**",
            "report", "")
    return [main, lone]


def _push_rows(push: dict | None, learner: dict | None) -> list[tuple[str, str, str, str, str]]:
    err = _error(push)
    if err:
        return [("weight push", "optimizer step end -> first completion of the new version", err, "<= 1 s", "")]
    ckpt = (learner or {}).get("checkpoint_in_step_median_s")
    server = push.get("server") or {}
    srv = server.get("median_s", {})
    answered = srv.get("first_completion_answered_after_push_start_s")
    total = None if answered is None else answered + (ckpt or 0.0)
    rounds = [r["first_completion_answered_after_push_start_s"] for r in server.get("rounds", [])]
    main = ("weight push", f"end of an optimizer step -> first completion of the new version answered through the "
            f"front end (the default path: the checkpoint's part of the step, the push beside its write, the "
            f"client's status polls every 50 ms, then `POST .../completions`, n=1, 8 tokens); SmolLM2, LoRA r=16 on 7 "
            f"modules; median of {len(rounds)} rounds",
            f"**{_f(total, 2)} s** = checkpoint in the step {_f(ckpt, 3)} (learner figure) + push start -> first "
            f"completion answered {_f(answered, 3)} (of which the push {_f(srv.get('push_s'), 3)}; rounds "
            f"{', '.join(_f(x, 2) for x in rounds)})"
            + ("" if ckpt is not None else " The learner figure did not run: no checkpoint in the sum."),
            "<= 1 s", _verdict(total, 1.0, higher_is_better=False))
    m = (push.get("lone") or push["direct"])["median_s"]
    variant = ("weight push, worker verbs (variant)", f"the learner's and sampler's verbs called directly, no "
               f"checkpoint, no front end (median of {push['direct']['rounds']})",
               f"{_f(m['push_total'], 2)} s = save_adapter {_f(m['save_adapter'], 3)} + load_adapter "
               f"{_f(m['load_adapter'], 3)} + first completion {_f(m['first_completion'], 3)}; then a probe check "
               f"(two completions scored alone) {_f(m['verification'], 3)} s", "report", "")
    return [main, variant]


def _learner_rows(le: dict | None) -> list[tuple[str, str, str, str, str]]:
    err = _error(le)
    if err:
        return [("learner", "trainer vs plain peft loop", err, ">= 0.9", "")]
    pad = le["padding"]
    rounds = [p / l for p, l in zip(le["plain_step_s"], le["learner_step_s"])]
    what = (f"training tok/s (prompt + completion) of `MultiAdapterTrainer.train` (DeepSpeed ZeRO-2) vs plain peft + "
            f"torch AdamW on the same micro-batches and loss; {le['sequences']} sequences (groups of "
            f"{le['group_size']}, completions 4-{le['max_completion']} tokens), {le['steps']} rounds of "
            f"{le.get('block', 1)} steps back to back a side, alternating, "
            f"{'under bf16 autocast (the default on this CPU), float32 weights' if le.get('autocast') else 'float32'}")
    if "checkpoint_interval_s" in le:  # since checkpoint_interval_s (30 s by default)
        cadence = (f"a checkpoint after the first step {_f(le['checkpoint_interval_s'], 0)} s after the last one "
                   f"started ({le['checkpoints_written']} in its {le['steps'] * le.get('block', 1)} timed steps)")
    else:
        cadence = "a checkpoint after every step"
    main = ("learner", f"{what}; the learner on its defaults: {cadence}, copied in the step and "
            f"written beside the next (each block waits for its last write)",
            f"{_f(le['learner_with_checkpoint_tok_s'], 1)} vs {_f(le['plain_tok_s'], 1)} tok/s: "
            f"**{_f(le['ratio_with_checkpoint'], 3)}** (the checkpoint's part of a step that wrote one "
            f"{_f(le.get('checkpoint_in_step_median_s'), 3)} s; per round {', '.join(_f(x, 2) for x in rounds)}). "
            f"Padding waste: {pad['padded_tokens']} padded / {pad['real_tokens']} real tokens = "
            f"{_f(pad['padded_over_real'], 3)} ({pad['micro_batches']} micro-batches of {le['micro_batch_size']})",
            ">= 0.9", _verdict(le["ratio_with_checkpoint"], 0.9) + _spread(rounds, 1.3))
    variant = ("learner, no checkpoint (variant)", "the same blocks with checkpoints off",
               f"{_f(le['learner_tok_s'], 1)} vs {_f(le['plain_tok_s'], 1)} tok/s: **{_f(le['ratio'], 3)}**; fastest "
               f"block of each side, with checkpoints: {_f(le.get('ratio_fastest_steps'), 3)}", "report", "")
    return [main, variant]


def render(results: dict) -> str:
    meta, figs = results["meta"], results["figures"]
    rows = []

    fe = figs.get("front_end")
    err = _error(fe)
    if err:
        rows.append(("front-end overhead", "HTTP API vs the same engine in-process", err, ">= 0.95", ""))
    else:
        rows.append(("front-end overhead",
                     f"completions tok/s through `POST /v1/experiments/bench1/completions` vs vLLM AsyncLLM "
                     f"in-process (sampler's engine args, same adapter v0, {fe.get('served_as', 'lora')} on both sides); "
                     f"{_rounds(fe)}",
                     f"{_f(fe['server_tok_s'], 1)} vs {_f(fe['direct_tok_s'], 1)} tok/s: **{_f(fe['ratio'], 3)}** "
                     f"(per round {', '.join(_f(r, 2) for r in fe['round_ratios'])})",
                     ">= 0.95", _verdict(fe["ratio"], 0.95) + _spread(fe["round_ratios"])))

    rows.append(_episodes_row(figs.get("episodes")))

    ov = figs.get("overlap")
    err = _error(ov)
    if err:
        rows.append(("overlap", "completion tok/s while the learner trains vs idle", err, "report", ""))
    else:
        rows.append(("overlap",
                     f"completion tok/s through the server while the learner runs train steps back to back vs "
                     f"while it is idle (one process each, same box; the learner's train verb called directly, so "
                     f"the server's `schedule` does not keep them apart, as `alternate` does on a CPU host); "
                     f"{_rounds(ov)}",
                     f"{_f(ov['busy_tok_s'], 1)} vs {_f(ov['idle_tok_s'], 1)} tok/s: **{_f(ov['ratio'], 2)}** "
                     f"({ov['train_steps_during_busy']} train steps meanwhile); sampling never stops",
                     "report", ""))

    rows += _adapter_rows(figs.get("adapter"))
    rows += _push_rows(figs.get("push"), figs.get("learner"))
    rows += _learner_rows(figs.get("learner"))

    ex = figs.get("experiments")
    err = _error(ex)
    if err:
        rows.append(("experiments", "1, 2, 4 experiments sampling at once", err, "report", ""))
    else:
        curve = "; ".join(f"{lv['experiments']}: {_f(lv['total_tok_s'], 1)} total, "
                          f"{_f(lv['mean_per_experiment_tok_s'], 1)} each"
                          + (f" ({_f(lv['total_tok_s_vs_one'], 2)}x one; worst p95 {_f(lv['worst_p95_vs_one'], 2)}x)"
                             if "worst_p95_vs_one" in lv else "") for lv in ex["levels"])
        rows.append(("experiments",
                     f"completion tok/s in total and per experiment with k experiments sampling at once on one "
                     f"base model through the server; each: {ex['requests_per_experiment']} request(s) x n={ex['n']}, "
                     f"max_tokens {ex['max_tokens']}, {ex['concurrency_per_experiment']} at a time; "
                     f"sampler max_loras {ex['max_loras']}"
                     + (f", several_experiments {ex['several_experiments']}, cpu_lora_ops {ex['cpu_lora_ops']}"
                        if "several_experiments" in ex else ""),
                     f"k = {curve}", "report", ""))

    mem = figs.get("memory")
    err = _error(mem)
    if err:
        rows.append(("memory", "peak RSS", err, "report", ""))
    else:
        parts = []
        for k, snap in mem["snapshots"].items():
            parts.append(f"{k} exp: front end {_f(snap['front_end']['hwm_mib'], 0)}, sampler "
                         f"{_f(snap.get('sampler', {}).get('hwm_mib'), 0)}, learner "
                         f"{_f(snap.get('learner', {}).get('hwm_mib'), 0)}")
        rows.append(("memory",
                     "peak RSS (VmHWM, MiB) of each process with its children (the sampler's vLLM engine core "
                     "and worker count under the sampler), after k experiments each sampled and trained one step",
                     "; ".join(parts), "report", ""))

    rows.append(_end_to_end_row(figs.get("end_to_end")))

    lines = [
        f"## Summary: `scripts/bench{' --quick' if meta['mode'] == 'quick' else ''}` ({meta['mode']} mode)",
        "",
        *_run_line(meta),
        "",
        "| figure | what is compared | measured | target | verdict |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows]
    return "\n".join(lines) + "\n"


def render_extra(results: dict, name: str) -> str:
    """The block of the extra figure `name` (EXTRA): the run's line and the figure's table."""
    meta, fig = results["meta"], results["figures"][name]
    if name == "rollouts" and not _error(fig):
        return "\n".join([*_run_line(meta), "", *_rollouts_table(fig)]) + "\n"
    if name == "tenants" and not _error(fig):
        return "\n".join([*_tenants_run_line(meta, fig), "", *_tenants_table(fig)]) + "\n"
    if name == "chaos":
        return "\n".join(chaos_block(meta, fig)) + "\n"
    row = {"fairness": _fairness_row, "hostile": _hostile_row, "rollouts": _rollouts_row,
           "tenants": _tenants_row}[name](fig)
    return "\n".join([*_run_line(meta), "", "| figure | what is compared | measured | target | verdict |",
                      "|---|---|---|---|---|", "| " + " | ".join(row) + " |"]) + "\n"


def _rollouts_table(ro: dict) -> list[str]:
    """One row per level: this server against `vllm serve`, side by side."""
    _, what, _, target, verdict = _rollouts_row(ro)
    eager = any("E" in lv for lv in ro["levels"])
    lora = any("L" in lv for lv in ro["levels"])
    lines = [f"{what}. Target: {target}. Verdict: {verdict}.", "",
             "| episodes in flight | episodes/s: this server vs vllm serve | ratio | turn p50 / p95 (s): this server "
             "vs vllm serve | p95 ratio | "
             + ("vllm serve eager, episodes/s: ratio | " if eager else "")
             + ("vllm serve with LoRA, episodes/s | " if lora else "")
             + "later turns' prefix-cache hits | front end: RSS, loop lag p99 | 429 / 5xx | verdict |",
             "|---|---|---|---|---|" + ("---|" if eager else "") + ("---|" if lora else "") + "---|---|---|---|"]
    for lv in ro["levels"]:
        a, b = lv["A"], lv["B"]
        missed = ([f"episodes/s {_f(lv['eps_ratio'], 2)}"] if lv["eps_ratio"] is None
                  or lv["eps_ratio"] < ro["target_eps_ratio"] else []) \
            + ([f"p95 {_f(lv['p95_ratio'], 2)}x"] if lv["p95_ratio"] is None or lv["p95_ratio"] > ro["target_p95_ratio"]
               else []) + ([f"{a['failures_5xx']} 5xx"] if a["failures_5xx"] or a["failed_episodes"] else [])
        lines.append(
            f"| {lv['level']} | {_f(a['eps'], 2)} vs {_f(b['eps'], 2)} | **{_f(lv['eps_ratio'], 3)}** | "
            f"{_f(a['p50_s'], 2)} / {_f(a['p95_s'], 2)} vs {_f(b['p50_s'], 2)} / {_f(b['p95_s'], 2)} | "
            f"**{_f(lv['p95_ratio'], 2)}x** | "
            + (f"{_f(lv['E']['eps'], 2)}: **{_f(lv.get('eps_ratio_vs_eager'), 3)}** | " if "E" in lv else
               ("not run | " if eager else ""))
            + (f"{_f(lv['L']['eps'], 2)} | " if "L" in lv else ("not run | " if lora else ""))
            + f"{_f(a['prefix_cache_hit_rate_later_turns'], 3)} | {_f(a['front_end_rss_mib'], 0)} MiB, "
            f"{_f(a['loop_lag_p99_s'], 3)} s | {a['answers_429']} / {a['failures_5xx']} | "
            + (f"**missed**: {'; '.join(missed)}" if missed else "met") + " |")
    idle = ", ".join(f"{k} {_f(v, 3)}" for k, v in ro.get("idle_cpu", {}).items())
    lines += ["", f"Idle CPU of each side (cores): {idle}. Tool calls written by the model in the timed turns: "
              + ", ".join(f"k={lv['level']}: {lv['A']['tool_calls']} vs {lv['B']['tool_calls']}"
                          for lv in ro["levels"]) + "."]
    return lines
