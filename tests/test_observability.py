"""Watching a run: the metrics log per experiment (`RUN_DIR/metrics/<name>.jsonl`) and its endpoint,
`grpo-server plot`, the status page at `/` rendered by a real headless Chromium, and the start-up's
progress lines."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from grpo_server.workers import processes as supervisor
from grpo_server.api_models import ExperimentCounters, VerificationResult
from grpo_server.cli import main as cli_main
from grpo_server.runtime.metrics_log import MetricsLog, metrics_log_path
from grpo_server.plot import load_series
from grpo_server.workers.processes import WorkerProcess
from grpo_server.protocol import archive
from grpo_server.protocol.wire import TrainMetrics
from grpo_server.protocol.listen import free_port
from tests.serving import ADMIN_KEY, headers, wait_for

EXP = "obs-page"
EXP_KEY = "key-obs-page-8c1e"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def train_metrics(step: int, **overrides) -> TrainMetrics:
    values = dict(step=step, loss=0.5, reward_mean=0.1 * step, reward_std=0.2, kl=0.01 * step,
                  clipped_fraction=0.0, ratio_mean=1.0, ratio_std=0.0, ratio_min=1.0, ratio_max=1.0,
                  grad_norm=0.3, tokens=64, seconds=1.5)
    return TrainMetrics(**{**values, **overrides})


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------------------------
# The log and the plot, without a server
# ------------------------------------------------------------------------------------------------


def test_metrics_log_lines_and_history_across_reopen(tmp_path):
    path = metrics_log_path(tmp_path, "exp")
    log = MetricsLog(path)
    log.train(train_metrics(1, kl=float("nan")), policy_version=0, groups=2)
    log.push(1, 1, 0.25, VerificationResult(version=1, mean_abs_diff=0.0, max_abs_diff=0.0, tokens=4, ok=True))
    log.sampling(ExperimentCounters())  # nothing sampled: no line
    log.sampling(ExperimentCounters(groups_sampled=3, completions_sampled=12, tokens_sampled=96))
    log.sampling(ExperimentCounters(groups_sampled=3, completions_sampled=12, tokens_sampled=96))  # idle again
    log.close()

    lines = read_lines(path)
    assert [line["kind"] for line in lines] == ["train", "push", "sampling"]
    assert all(isinstance(line["time"], float) for line in lines)
    train, push, sampling = lines
    assert train["step"] == 1 and train["policy_version"] == 0 and train["groups"] == 2
    assert train["reward_mean"] == pytest.approx(0.1) and train["step_seconds"] == 1.5 and train["tokens"] == 64
    assert train["kl"] is None  # NaN is not JSON
    assert "checkpointed_journal_seq" not in train
    assert push == {**push, "version": 1, "step": 1, "push_seconds": 0.25, "verified": True, "mean_abs_diff": 0.0}
    assert (sampling["groups"], sampling["completions"], sampling["completion_tokens"]) == (3, 12, 96)
    assert sampling["tokens_per_s"] == pytest.approx(96 / sampling["interval_s"])

    # A crash cut the last line short: it is skipped, and the next line does not get glued to it.
    with open(path, "a") as file:
        file.write('{"time": 1, "kind": "tra')
    reopened = MetricsLog(path)
    assert [r["kind"] for r in reopened.records()] == ["train", "push", "sampling"]
    reopened.train(train_metrics(2), policy_version=1, groups=2)
    reopened.close()
    assert json.loads(path.read_text().splitlines()[-1])["step"] == 2
    assert [r["step"] for r in MetricsLog(path).records("train", limit=5)] == [1, 2]


def test_plot_writes_a_png_per_experiment(tmp_path, capsys):
    for name, steps in (("alpha", 5), ("beta", 2)):
        log = MetricsLog(metrics_log_path(tmp_path, name))
        for step in range(1, steps + 1):
            log.train(train_metrics(step), policy_version=step - 1, groups=2)
            log.push(step, step, 0.1, None)
            log.sampling(ExperimentCounters(groups_sampled=step, completions_sampled=4 * step, tokens_sampled=32 * step))
        log.close()

    assert cli_main(["plot", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / "plots" / "alpha.png"), str(tmp_path / "plots" / "beta.png")]
    for path in printed:
        assert Path(path).read_bytes()[:8] == PNG_SIGNATURE and Path(path).stat().st_size > 10_000

    series = load_series(metrics_log_path(tmp_path, "alpha"))
    assert series.step == [1, 2, 3, 4, 5]
    assert series.reward_mean == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert series.kl == pytest.approx([0.01, 0.02, 0.03, 0.04, 0.05])
    assert len(series.reward_std) == 5 and len(series.tokens_per_s) == len(series.sampling_minutes) == 5
    assert series.push_steps == [1, 2, 3, 4, 5]

    assert cli_main(["plot", "--describe", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == str(tmp_path / "plots" / "alpha.png")  # the rewards 0.1 .. 0.5, rising
    assert lines[1] == "  alpha: 5 steps, mean reward 0.10 (first 1) -> 0.50 (last 1); per step 0.10 ▁▃▅▇█ 0.50"
    assert lines[3].startswith("  beta: 2 steps, mean reward 0.10 (first 1) -> 0.20 (last 1)")


def test_the_kl_panel_at_beta_0_says_kl_is_off_and_draws_the_mismatch_and_each_push_check(tmp_path):
    from matplotlib.figure import Figure

    from grpo_server.plot import PUSH_COLOURS, _kl_panel

    log = MetricsLog(metrics_log_path(tmp_path, "nokl"))
    checks = [VerificationResult(version=1, mean_abs_diff=0.0, max_abs_diff=0.0, tokens=4, ok=True),
              VerificationResult(version=2, mean_abs_diff=0.3, max_abs_diff=0.9, tokens=4, ok=False), None]
    for step, check in enumerate(checks, start=1):
        log.train(train_metrics(step, kl=None, mismatch_kl_fresh=1e-9 * step, offpolicy_kl_stale=0.02 * step),
                  policy_version=step - 1, groups=2)
        log.push(step, step, 0.1, check)
    log.close()
    series = load_series(metrics_log_path(tmp_path, "nokl"))
    assert series.mismatch_kl_fresh == pytest.approx([1e-9, 2e-9, 3e-9])
    assert series.offpolicy_kl_stale == pytest.approx([0.02, 0.04, 0.06])
    assert series.push_verified == [True, False, None]

    axes = Figure().subplots()
    _kl_panel(axes, series)
    assert "off, beta 0" in axes.get_title() and axes.get_yscale() == "log"
    drawn = {line.get_label(): line for line in axes.get_lines()}
    assert "KL to the base model" not in drawn  # nothing to draw: said in the title instead
    assert {"mismatch KL (current version's tokens)", "off-policy KL (older versions' tokens)"} <= set(drawn)
    pushes = [line for line in axes.get_lines() if line.get_xdata()[0] == line.get_xdata()[-1]]  # the verticals
    assert [(line.get_xdata()[0], line.get_color()) for line in sorted(pushes, key=lambda l: l.get_xdata()[0])] == [
        (1, PUSH_COLOURS[True]), (2, PUSH_COLOURS[False]), (3, PUSH_COLOURS[None])]


def test_sparkline_keeps_the_shape_of_a_long_curve():
    from grpo_server.plot import SPARK_WIDTH, sparkline

    rising = sparkline([i / 99 for i in range(100)])
    assert len(rising) == SPARK_WIDTH and rising[0] == "▁" and rising[-1] == "█"
    assert list(rising) == sorted(rising)  # averaged buckets of a rising curve still rise
    assert sparkline([0.5, float("nan"), 0.5]) == "▁▁" and sparkline([]) == ""


def test_plot_without_metrics_says_so(tmp_path, capsys):
    assert cli_main(["plot", str(tmp_path)]) != 0
    error = capsys.readouterr().err
    assert "no metrics logs" in error and str(tmp_path / "metrics") in error


# ------------------------------------------------------------------------------------------------
# Start-up progress
# ------------------------------------------------------------------------------------------------

# Listens only after a second, as a model load would (much later).
SLOW_WORKER = """
import sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
print("loading weights", flush=True)
time.sleep(1.0)
class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args): pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


async def test_startup_says_it_is_waiting_for_a_worker(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(supervisor, "HEALTH_PROGRESS_S", 0.2)
    port = free_port()
    worker = WorkerProcess("slow", [sys.executable, "-c", SLOW_WORKER, str(port)], f"http://127.0.0.1:{port}",
                           tmp_path / "slow.log", startup_timeout_s=60)
    with caplog.at_level(logging.INFO, logger="grpo_server.workers.processes"):
        await worker.start()
    await worker.stop()
    messages = [r.getMessage() for r in caplog.records]
    waiting = [m for m in messages if m.startswith("slow: waiting for health")]
    assert waiting, messages
    assert re.search(r"waiting for health, \d+ s of 60 s; its log's last line: loading weights", waiting[-1])
    assert any(re.fullmatch(rf"slow: healthy at http://127.0.0.1:{port} after \d+\.\d s", m) for m in messages)


# ------------------------------------------------------------------------------------------------
# On the real server: a trained step in the log and the endpoint, then the page in Chromium
# ------------------------------------------------------------------------------------------------


async def _trained(client):
    status = await client.status(EXP)
    return status if status.step >= 1 and status.policy_version >= 1 else None


def _log_has(path: Path, kind: str):
    async def check():
        return path.is_file() and any(line["kind"] == kind for line in read_lines(path))
    return check


@pytest.fixture(scope="module")
async def trained(server):
    """An experiment of its own (a batch is one group) that trained one step and pushed v1."""
    from grpo_server.client import AsyncClient

    async with AsyncClient(server.url, server.api_key) as client:
        await client.create_experiment({"name": EXP, "api_key": EXP_KEY, "algorithm": {"batch_groups": 1},
                                        "sampling": {"n": 4, "max_tokens": 4, "temperature": 1.0}})
        group = await client.complete(EXP, prompt="Name a fruit:")
        await client.feedback(EXP, group.group_id, [1.0, 0.0, 0.5, 0.0])
        status = await wait_for(lambda: _trained(client), timeout_s=180)
        # The push line is written once the version is checked: with no next batch, after verify_idle_s.
        await wait_for(_log_has(metrics_log_path(server.run_dir, EXP), "push"), timeout_s=60)
        # The throughput line comes at the next tick of the sampling log.
        await wait_for(_log_has(metrics_log_path(server.run_dir, EXP), "sampling"), timeout_s=60)
        yield status
        await client.delete_experiment(EXP)
    # A deleted experiment's history stays, in its archive (grpo_server/protocol/archive.py).
    assert not metrics_log_path(server.run_dir, EXP).exists()
    assert [(archive.folder(server.run_dir, label) / "metrics.jsonl").is_file()
            for label in archive.labels(server.run_dir, EXP)] == [True]


async def test_a_trained_step_and_its_push_are_logged(server, trained):
    lines = read_lines(metrics_log_path(server.run_dir, EXP))
    train = [line for line in lines if line["kind"] == "train"]
    push = [line for line in lines if line["kind"] == "push"]
    sampling = [line for line in lines if line["kind"] == "sampling"]
    assert [line["step"] for line in train] == [1]
    assert train[0]["groups"] == 1 and train[0]["tokens"] > 0
    assert train[0]["reward_mean"] == pytest.approx(trained.last_metrics["reward_mean"])  # what the front end got
    assert train[0]["policy_version"] == 0 and train[0]["step_seconds"] > 0
    assert [line["version"] for line in push] == [1]
    assert push[0]["verified"] is True and push[0]["push_seconds"] > 0
    assert sum(line["completions"] for line in sampling) == 4
    assert sum(line["completion_tokens"] for line in sampling) == trained.counters.tokens_sampled


async def test_metrics_endpoint(server, trained):
    url = f"{server.url}/v1/experiments/{EXP}/metrics"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async with session.get(url, params={"kind": "train"}, headers=headers(EXP_KEY)) as response:
            assert response.status == 200
            body = await response.json()
        assert body["name"] == EXP and [r["step"] for r in body["records"]] == [1]
        async with session.get(url, params={"limit": "2"}, headers=headers()) as response:
            records = (await response.json())["records"]
        assert len(records) == 2 and records[0]["time"] <= records[1]["time"]
        for params, code in (({"kind": "loss"}, "bad_kind"), ({"limit": "0"}, "bad_limit"),
                             ({"limit": "many"}, "bad_limit")):
            async with session.get(url, params=params, headers=headers()) as response:
                assert response.status == 400 and (await response.json())["error"]["code"] == code
        async with session.get(url) as response:
            assert response.status == 401
        async with session.get(f"{server.url}/v1/experiments/no-such-exp/metrics", headers=headers()) as response:
            assert response.status == 404


def chromium() -> str:
    found = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        pytest.fail("chromium is not installed: run scripts/setup (as root it installs it with apt-get), "
                    "or install chromium and/or set CHROMIUM to its path")
    return found


async def test_status_page_is_public_html_without_data(server):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async with session.get(f"{server.url}/") as response:
            assert response.status == 200 and response.content_type == "text/html"
            policy = response.headers["Content-Security-Policy"]
            page = await response.text()
    assert "connect-src 'self'" in policy and "'unsafe-inline'" not in policy
    assert "/v1/experiments" in page and ADMIN_KEY not in page and EXP not in page


def test_status_page_renders_experiments_in_chromium(server, trained, tmp_path):
    """A real browser runs the page's script: it takes the key from the fragment, fetches the API and draws."""
    browser = chromium()
    result = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000", "--dump-dom",
         f"{server.url}/#key={EXP_KEY}"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    dom = result.stdout
    row = re.search(rf'<tr data-experiment="{EXP}">(.*?)</tr>', dom, flags=re.S)
    assert row, dom[-3000:]
    assert f'<td data-field="policy_version">{trained.policy_version}</td>' in row.group(1)
    assert f'<td data-field="step">{trained.step}</td>' in row.group(1)
    assert '<td data-field="groups_trained">1</td>' in row.group(1)
    # The reward curve: a polyline drawn from the metrics endpoint's train records (one step: one point).
    figure = re.search(rf'<figure data-experiment="{EXP}">(.*?)</figure>', dom, flags=re.S)
    assert figure and re.search(r'<polyline points="[\d.]+,[\d.]+"', figure.group(1)), dom[-3000:]
    # The fresh-token mismatch and the stale-token KL apart, and the last push's check (v1, verified).
    assert '<td data-field="mismatch_kl_fresh">' in row.group(1) and '<td data-field="offpolicy_kl_stale">' in row.group(1)
    assert "mismatch kl (fresh tokens)" in dom and "off-policy kl (stale tokens)" in dom
    assert '<td data-field="last_push_check">v1 ok</td>' in row.group(1)
    # The gap chart: each push as a line coloured by its check.
    gap = re.search(rf'<figure data-experiment="{EXP}" data-chart="gap">(.*?)</figure>', dom, flags=re.S)
    assert gap and 'data-verdict="ok"' in gap.group(1) and "1 ok" in gap.group(1), dom[-3000:]
    # An experiment key sees its own experiment only.
    assert dom.count("<tr data-experiment=") == 1
