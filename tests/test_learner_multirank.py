"""The learner as a multi-rank DeepSpeed job (2 CPU ranks over gloo), on the tiny Llama.

Started and driven as the front end does it: `python -m learner --config` under the supervisor's
WorkerProcess, verbs through the LearnerClient. Two ranks must train exactly like one: the same batch
(sequences of different lengths, two sampling temperatures, an odd split that leaves rank 1 a padding
pass) gives the same adapter weights and metrics, for a sequence-normalised loss (grpo) and a
token-normalised one with the KL term (dapo). A dead rank takes the job down, the supervisor restarts
it, and it resumes from its per-rank checkpoint shards exactly. No rank outlives a killed rank 0. And the
lockstep protocol alone (stand-in trainers, a follower thread): errors every rank shares are ordinary
answers, a failure on one rank is reported with its cause and ends the job.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import pytest
import yaml

from grpo_server.config import AlgorithmConfig, LoraConfig
from grpo_server.protocol.errors import ApiError
from grpo_server.workers.processes import WorkerProcess
from grpo_server.protocol.wire import (AddExperimentRequest, LogprobsRequest, TrainMetrics, TrainRequest, TrainSample)
from grpo_server.protocol.verbs import LearnerClient, LearnerVerbs
from grpo_server.protocol.worker_auth import auth_headers
from grpo_server.workers.pool import WorkerConnection
from learner.lockstep import CommandChannel, LockstepTrainer, follow
from learner.ranks import RankEnv, host_store, join_store
from tests.serving import WORKER_SECRET, free_port, worker_env
from tests.tolerances import SAME_STEP_METRICS, SAME_STEP_WEIGHTS, observed, rel_within

REPO = Path(__file__).resolve().parents[1]
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LORA = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
ALGORITHMS = {
    # checkpoint_interval_s 0: a checkpoint after every step, each rank told so by rank 0.
    "seqmean": AlgorithmConfig(loss="grpo", learning_rate=1e-3, weight_decay=0.01, max_grad_norm=0.5,
                               micro_batch_size=2, checkpoint_interval_s=0),
    "tokmean": AlgorithmConfig(loss="dapo", beta=0.05, learning_rate=1e-3, max_grad_norm=0.5, micro_batch_size=2,
                               checkpoint_interval_s=0),
}
# (prompt length, completion length, advantage, temperature). One rank cuts 3 micro-batches of at most 2
# (one per temperature at least); two ranks get 3 and 2 sequences: rank 1 has one micro-batch and pads.
SHAPES = [(3, 4, 1.2, 0.8), (7, 1, -0.5, 1.0), (2, 6, 0.3, 1.0), (5, 3, -1.0, 1.0), (9, 2, 0.7, 1.0)]


def _env() -> dict[str, str]:
    # Another test's in-process rank variables must not reach the job.
    return {k: v for k, v in worker_env().items() if k not in DIST_ENV}


def _write_config(folder: Path, model_dir: Path, ranks: int) -> tuple[Path, int]:
    port = free_port()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "learner.yaml"
    path.write_text(yaml.safe_dump({"model_path": str(model_dir), "run_dir": str(folder / "run"), "port": port,
                                    "max_model_len": 128, "ranks": ranks, "collective_timeout_s": 60,
                                    "dtype": "float32"}))
    return path, port


def _job_pids(config_path: Path) -> dict[str, int]:
    """{'rank0': pid, 'rank1': pid, ...} of the live processes of the job started with `config_path`."""
    pids = {}
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        args = [a.decode(errors="replace") for a in argv]
        # Rank 0 has the path as given, the followers it starts the resolved one.
        if state != "Z" and "learner" in args and {str(config_path), str(config_path.resolve())} & set(args):
            rank = args[args.index("--rank") + 1] if "--rank" in args else "0"
            pids[f"rank{rank}"] = int(entry.name)
    return pids


def _wait_gone(pids: list[int], timeout_s: float = 60.0) -> list[int]:
    """The pids still alive (not zombies) after waiting up to `timeout_s` for all of them to go."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in pids if Path(f"/proc/{p}").exists()
                 and (Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z")]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _supervised(name: str, config_path: Path, port: int) -> WorkerProcess:
    return WorkerProcess(name, [sys.executable, "-m", "learner", "--config", str(config_path)],
                         f"http://127.0.0.1:{port}", config_path.parent / "learner.log", env=_env(),
                         startup_timeout_s=300)


def _batch(name: str, logprobs: list[list[float]], prompts: list[list[int]], completions: list[list[int]]):
    samples = []
    for i, ((_, _, advantage, temperature), prompt, completion, current) in enumerate(
            zip(SHAPES, prompts, completions, logprobs)):
        # Off-policy: the sampler's logprobs moved off the current policy, so ratios spread and some clip.
        behaviour = [min(x + (0.35 if (i + j) % 2 else -0.3), 0.0) for j, x in enumerate(current)]
        samples.append(TrainSample(prompt_token_ids=prompt, completion_token_ids=completion,
                                   sampler_logprobs=behaviour, advantage=advantage, reward=float(i),
                                   policy_version=0, temperature=temperature))
    return TrainRequest(name=name, samples=samples, max_tokens=8)


async def _current_logprobs(client: LearnerClient, name: str, prompts, completions) -> list[list[float]]:
    rows = []
    for (_, _, _, temperature), prompt, completion in zip(SHAPES, prompts, completions):
        answer = await client.logprobs(LogprobsRequest(name=name, prompt_token_ids=prompt,
                                                       completions_token_ids=[completion], temperature=temperature))
        rows.append(answer.logprobs[0])
    return rows


def _load(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "adapter_model.safetensors"))


async def _train_both(clients: list[LearnerClient], batch: TrainRequest, step: int) -> TrainMetrics:
    """One step on both jobs; their metrics must agree. Returns the 2-rank job's."""
    m_one, m_two = [await c.train(batch) for c in clients]
    assert m_one.step == m_two.step == step and m_one.tokens == m_two.tokens == 16
    assert (m_one.kl is None) == (m_two.kl is None)  # None when beta = 0
    for field in ("loss", "grad_norm", "ratio_mean", "ratio_std", "clipped_fraction", "kl", "ratio_min", "ratio_max"):
        a, b = getattr(m_one, field), getattr(m_two, field)
        assert a == b is None or rel_within(SAME_STEP_METRICS, a, b, abs_floor=1e-7), (batch.name, step, field, a, b)
    assert m_one.grad_norm > 0
    return m_two


async def _assert_same_adapters(clients: list[LearnerClient], name: str, version: int, before: str) -> None:
    """Both jobs save `version`; the weights agree to float noise and moved well beyond it since `before`."""
    saved = [await c.save_adapter(name) for c in clients]
    assert [v.version for v in saved] == [version, version]
    w_one, w_two, w_before = _load(saved[0].path), _load(saved[1].path), _load(before)
    assert w_one.keys() == w_two.keys() == w_before.keys()
    diff = max(float((w_one[k] - w_two[k]).abs().max()) for k in w_one)
    moved = max(float((w_one[k] - w_before[k]).abs().max()) for k in w_one)
    print(f"{name} v{version}: 1 rank vs 2 ranks, max |diff| {diff:.2e}; moved {moved:.2e}")
    assert observed(SAME_STEP_WEIGHTS, diff) and moved > 5e-4, (name, version, diff, moved)


async def _wait_restarted(worker: WorkerProcess, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while worker.ready:  # until the supervisor has seen the exit
        assert time.monotonic() < deadline, "the learner did not exit"
        await asyncio.sleep(0.2)
    while not worker.ready:
        assert time.monotonic() < deadline and worker.state != "failed", (worker.state, worker.last_error)
        await asyncio.sleep(0.5)


async def test_two_ranks_train_exactly_like_one_and_recover_together(tiny_model_dir, tmp_path):
    one_config, one_port = _write_config(tmp_path / "one", tiny_model_dir, ranks=1)
    two_config, two_port = _write_config(tmp_path / "two", tiny_model_dir, ranks=2)
    one, two = _supervised("learner-1rank", one_config, one_port), _supervised("learner-2ranks", two_config, two_port)
    checkpoints = two_config.parent / "run" / "checkpoints"
    pids: dict[str, int] = {}
    async with aiohttp.ClientSession(headers=auth_headers(WORKER_SECRET)) as session:  # as the front end's
        try:
            await asyncio.gather(one.start(), two.start())
            pids = _job_pids(two_config)
            assert set(pids) == {"rank0", "rank1"}, pids
            clients = [LearnerClient(WorkerConnection(worker, session, 300)) for worker in (one, two)]

            # Bad requests are answered by rank 0 as usual and leave the ranks in step (trained below).
            with pytest.raises(ApiError) as err:
                await clients[1].train(_batch("ghost", [[-1.0] * c for _, c, _, _ in SHAPES],
                                              [[5] * p for p, _, _, _ in SHAPES], [[6] * c for _, c, _, _ in SHAPES]))
            assert (err.value.status, err.value.code) == (404, "not_found")

            prompts = [[(97 * i + 13 * k) % 4000 + 3 for k in range(p)] for i, (p, _, _, _) in enumerate(SHAPES)]
            completions = [[(61 * i + 29 * k) % 4000 + 3 for k in range(c)] for i, (_, c, _, _) in enumerate(SHAPES)]
            batches = {}
            for name, algorithm in ALGORITHMS.items():
                request = AddExperimentRequest(name=name, lora=LORA, algorithm=algorithm)
                v0 = [await c.transport.request(LearnerVerbs.add_experiment, request) for c in clients]
                assert [v.version for v in v0] == [0, 0]
                with pytest.raises(ApiError) as err:  # the same ApiError on every rank: a normal answer
                    await clients[1].transport.request(LearnerVerbs.add_experiment, request)
                assert (err.value.status, err.value.code) == (409, "exists")
                batches[name] = _batch(name, await _current_logprobs(clients[0], name, prompts, completions),
                                       prompts, completions)
                for step in (1, 2):  # the second step moves lora_A too (lora_B != 0 after the first)
                    metrics = await _train_both(clients, batches[name], step)
                assert metrics.clipped_fraction > 0 and (metrics.kl is not None) == (algorithm.beta > 0)
                await _assert_same_adapters(clients, name, 1, before=v0[0].path)
                # Checkpointed every step, with each rank's optimizer shard. A thread writes it beside the next
                # verb and renames its folder into place once whole: waited for.
                deadline = time.monotonic() + 60
                while not (checkpoints / name / "step00000002" / "state.json").is_file():
                    assert time.monotonic() < deadline, f"{name}: no checkpoint at step 2 after 60 s"
                    await asyncio.sleep(0.1)
                state = yaml.safe_load((checkpoints / name / "step00000002" / "state.json").read_text())
                assert (state["ranks"], state["step"]) == (2, 2)
                assert {"optimizer.pt", "optimizer.rank1.pt", "rng.pt", "rng.rank1.pt"} <= {
                    p.name for p in (checkpoints / name / "step00000002").iterdir()}
            log = (two_config.parent / "learner.log").read_text()
            # Rank 1 really trained its share: one micro-batch and a padding pass per step.
            assert "5 sequences in 1 micro-batches (+1 padding) on rank 1 of 2" in log
            assert "5 sequences in 2 micro-batches (+0 padding) on rank 0 of 2" in log

            # A rank dies: the whole job exits, the supervisor restarts it, and re-added experiments resume
            # from their checkpoints (each rank its own optimizer shard): the next step matches the 1-rank
            # job's, which never stopped.
            os.kill(pids["rank1"], signal.SIGKILL)
            await _wait_restarted(two)
            assert two.last_error == "exited with code 1"
            assert _wait_gone(list(pids.values())) == []
            assert "rank 1 exited with code -9" in (two_config.parent / "learner.log").read_text()
            pids = _job_pids(two_config)
            for name, algorithm in ALGORITHMS.items():
                resumed = await clients[1].transport.request(LearnerVerbs.add_experiment, AddExperimentRequest(
                    name=name, lora=LORA, algorithm=algorithm))
                assert (resumed.step, resumed.version) == (2, 1)
                await _train_both(clients, batches[name], 3)
                await _assert_same_adapters(clients, name, 2, before=resumed.path)
        finally:
            await asyncio.gather(one.stop(), two.stop())

    # SIGTERM to the process group (as the supervisor stops it): rank 0 checkpointed with every rank's
    # shard, then told rank 1 to stop; nothing is left.
    assert set(pids) == {"rank0", "rank1"} and _wait_gone(list(pids.values())) == []
    assert "rank 1: stopping as rank 0 asked" in (two_config.parent / "learner.log").read_text()


def _start_plain(config_path: Path) -> subprocess.Popen:
    """The learner alone (no supervisor, whose process-group kill would hide what this tests)."""
    return subprocess.Popen([sys.executable, "-m", "learner", "--config", str(config_path)], cwd=REPO, env=_env(),
                            stdout=open(config_path.parent / "learner.log", "w"), stderr=subprocess.STDOUT)


async def _wait_healthy(process: subprocess.Popen, port: int, log_path: Path) -> None:
    deadline = time.monotonic() + 300
    async with aiohttp.ClientSession() as session:
        while True:
            assert process.poll() is None, log_path.read_text()[-3000:]
            try:
                async with session.get(f"http://127.0.0.1:{port}/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            assert time.monotonic() < deadline, "learner not healthy in 300 s"
            await asyncio.sleep(0.5)


async def test_killing_the_learner_leaves_no_rank_behind(tiny_model_dir, tmp_path):
    config_path, port = _write_config(tmp_path / "killed", tiny_model_dir, ranks=2)
    learner = _start_plain(config_path)
    try:
        await _wait_healthy(learner, port, config_path.parent / "learner.log")
        pids = _job_pids(config_path)
        assert set(pids) == {"rank0", "rank1"} and pids["rank0"] == learner.pid

        # SIGKILL to rank 0 alone (the OOM killer, `kill -9`): no handler of ours runs; the kernel ends rank 1.
        os.kill(learner.pid, signal.SIGKILL)
        assert learner.wait(timeout=60) == -signal.SIGKILL
        assert _wait_gone([pids["rank1"]]) == []
    finally:
        if learner.poll() is None:
            learner.kill()
            learner.wait()


class _FakeTrainer:
    """Records the verbs it runs; `fail_train` makes train fail as an out-of-memory on this rank would."""

    def __init__(self, fail_train: bool = False):
        self.fail_train = fail_train
        self.calls: list[tuple[str, str]] = []

    def add_experiment(self, name: str) -> str:
        self.calls.append(("add_experiment", name))
        if name == "taken":
            raise ApiError(f"experiment {name!r} is already loaded in the learner", code="exists", status=409)
        return f"added {name}"

    def train(self, batch: str) -> str:
        self.calls.append(("train", batch))
        if self.fail_train:
            raise MemoryError("injected: out of memory on this rank")
        return f"trained {batch}"


class _ThreadFollower:
    """Stands in for learner.ranks.Followers: here rank 1 is a thread of this process."""

    ranks = [1]

    def __init__(self, thread: threading.Thread, exit_codes: list[int]):
        self.thread, self.exit_codes = thread, exit_codes

    def exit_code(self, rank: int) -> int | None:  # -1: the thread raised (the test raises it after its join)
        return None if self.thread.is_alive() else (self.exit_codes or [-1])[0]

    def expect_exit(self) -> None:
        pass


def test_lockstep_answers_errors_all_ranks_share_and_reports_a_rank_that_fails_alone():
    """The protocol between rank 0 and a follower over the real store, with stand-in trainers."""
    store = host_store(2, timeout_s=30)
    follower_trainer, exit_codes, raised = _FakeTrainer(fail_train=True), [], []
    follower_channel = CommandChannel(join_store(RankEnv(1, 2, store.port), timeout_s=30))

    def run_follower() -> None:
        try:
            exit_codes.append(follow(follower_trainer, follower_channel, 1))
        except BaseException as exc:  # the test's failure: raised below, not lost with the thread
            raised.append(exc)

    thread = threading.Thread(target=run_follower, daemon=True)  # a failed assertion must not leave the session
    # waiting on it
    thread.start()
    broken: list[str] = []
    lockstep = LockstepTrainer(_FakeTrainer(), CommandChannel(store), _ThreadFollower(thread, exit_codes),
                               on_broken=broken.append, outcome_timeout_s=30)
    try:
        assert lockstep.add_experiment("a") == "added a"
        with pytest.raises(ApiError) as err:  # every rank raises it: a normal answer, the job goes on
            lockstep.add_experiment("taken")
        assert (err.value.code, err.value.status, broken) == ("exists", 409, [])

        with pytest.raises(ApiError) as err:  # only rank 1 fails: reported with its error, the job breaks
            lockstep.train("batch")
        assert (err.value.code, err.value.status) == ("rank_failed", 500)
        assert "rank 0: ok; rank 1: MemoryError: injected: out of memory on this rank" in err.value.message
        assert len(broken) == 1 and "MemoryError" in broken[0]
    finally:  # the follower's own failure first: what rank 0 saw of it follows from it
        thread.join(timeout=30)
        if raised:
            raise raised[0]
    assert not thread.is_alive(), "the follower did not leave the job"
    assert exit_codes == [1]  # the failed rank left the job
    assert follower_trainer.calls == [("add_experiment", "a"), ("add_experiment", "taken"), ("train", "batch")]
    with pytest.raises(ApiError) as err:  # nothing more reaches the ranks of a broken job
        lockstep.train("another")
    assert err.value.status == 503
