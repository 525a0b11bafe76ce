"""The tenants figure's anchor: `vllm serve --enable-lora` with the last level's adapters, under the same load as
the server (scripts/benchmarks/tenants.py; vllm_serve.py starts and stops it)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp

from .tenants_load import MAX_TOKENS, N, REQUEST_TIMEOUT_S, Record, Tenant, load_summary, log_text

async def anchor_load(url: str, tenants: list[Tenant], window_s: float, sampling: dict) -> dict:
    """A concurrent clients of `vllm serve`'s /v1/completions, each looping on its own adapter for `window_s`."""
    records = [Record(t.name) for t in tenants]
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def one(tenant: Tenant, record: Record | None) -> None:
            body = {"model": tenant.name, "prompt": tenant.prompt_ids or tenant.messages[0]["content"], "n": N,
                    "max_tokens": MAX_TOKENS, **sampling}
            asked = time.perf_counter()
            try:
                async with session.post(f"{url}/v1/completions", json=body) as response:
                    answer = await response.json(content_type=None)
                    status = response.status
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                if record is not None:
                    record.errors[type(exc).__name__] += 1
                await asyncio.sleep(0.5)
                return
            if record is None:
                return
            if status != 200:
                record.errors[str(status)] += 1
                await asyncio.sleep(0.5)
                return
            record.latencies.append(time.perf_counter() - asked)
            record.tokens += answer["usage"]["completion_tokens"]

        await one(tenants[0], None)  # warm-up, untimed (as the server's first completion)
        started = time.monotonic()

        async def loop(tenant: Tenant, record: Record) -> None:
            while time.monotonic() < started + window_s:
                await one(tenant, record)

        await asyncio.gather(*(loop(t, r) for t, r in zip(tenants, records)))
        seconds = time.monotonic() - started
    out = load_summary(records, seconds)
    out["failures"] = sum(out["errors"].values())
    return out


def anchor_command(model_dir: Path, port: int, cfg, template: Path, adapters: dict[str, Path],
                   options: dict) -> tuple[list[str], dict]:
    """vllm_serve.py's command with every adapter as a LoRA module, the sampler's adapter slots and its engine's
    seats (max_num_seqs + reserved_seqs: sampler/vllm_start.py `engine_args`)."""
    from .vllm_serve import vllm_serve_command

    (first, folder), *_ = adapters.items()
    command, env = vllm_serve_command(model_dir, port, cfg, template, cfg.tool_parser, first, folder,
                                      max_lora_rank=cfg.max_lora_rank)
    at = command.index("--lora-modules")
    command[at + 1:at + 2] = [f"{name}={path}" for name, path in adapters.items()]
    command[command.index("--max-num-seqs") + 1] = str(options["max_num_seqs"] + options["reserved_seqs"])
    command += ["--max-loras", str(options["max_loras"]),
                "--max-cpu-loras", str(max(options["max_cpu_loras"], options["max_loras"]))]
    return command, env


async def anchor_figure(model_dir: Path, work: Path, adapters: dict[str, Path], tenants: list[Tenant],
                        options: dict, sampler_dtype: str, max_model_len: int, window_s: float,
                        sampling: dict) -> dict:
    """`vllm serve` with the adapters, the same load (module doc); its error, if it could not start."""
    from transformers import AutoTokenizer

    from grpo_server.protocol.worker_config import SamplerConfig, SamplerOptions
    from tests.serving import free_port

    from .memory import tree_rss
    from .vllm_serve import start_vllm, stop_vllm

    cfg = SamplerConfig(model_path=model_dir, run_dir=work, port=1, max_model_len=max_model_len, dtype=sampler_dtype,
                        **{k: v for k, v in options.items() if k in SamplerOptions.model_fields})
    template = work / "chat_template.jinja"  # the model's own (the figure sends token ids to /v1/completions)
    template.write_text(AutoTokenizer.from_pretrained(str(model_dir)).chat_template)
    command, env = anchor_command(model_dir, free_port(), cfg, template, adapters, options)
    log_path = work / "vllm-serve.log"
    out: dict = {"command": " ".join(command), "adapters": len(adapters), "active": len(tenants),
                 "max_loras": options["max_loras"], "max_cpu_loras": options["max_cpu_loras"],
                 "max_num_seqs": options["max_num_seqs"] + options["reserved_seqs"], "dtype": sampler_dtype}
    started = time.perf_counter()
    try:
        server = await start_vllm("tenants", command, env, log_path)
    except Exception as exc:  # recorded, and the figure goes on
        tail = "\n".join(log_text(log_path).splitlines()[-30:])
        return {**out, "error": f"{type(exc).__name__}: {str(exc)[:400]}", "log_tail": tail[-3000:]}
    out["start_s"] = round(time.perf_counter() - started, 1)
    try:
        load = await anchor_load(server.url, tenants, window_s, sampling)
        load["rss_mib"] = tree_rss(server.process.pid)[1]  # at the end of the window
    finally:
        out["exit_code"] = await asyncio.to_thread(stop_vllm, server)
    return {**out, **load}
