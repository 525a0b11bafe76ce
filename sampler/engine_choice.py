"""Which engine to build: `config.engine` names it, and `auto` is vLLM when it is installed, else
transformers + peft.

The chosen engine's module is imported only here and only when it is built, so choosing costs no
torch / vLLM import (sampler/engine_interface.py, the interface, imports neither engine).
"""

from __future__ import annotations

from grpo_server.protocol.worker_config import SamplerConfig, pick_engine_name
from sampler.engine_interface import Engine


def create_engine(config: SamplerConfig) -> Engine:
    """The engine `config.engine` names (not started: the app's cleanup context starts it)."""
    if pick_engine_name(config.engine) == "vllm":
        from sampler.vllm_engine import VllmEngine

        return VllmEngine(config)
    from sampler.hf_engine import HfEngine

    return HfEngine(config)
