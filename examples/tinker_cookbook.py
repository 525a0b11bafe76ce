"""Run tinker-cookbook 0.6.1's `rl_loop` or `sl_loop` recipe against this server on the embedded model.

No cookbook file is changed. The wrapper (1) names the renderer for SmolLM2 (`qwen3_instruct`: ChatML, stops on
`<|im_end|>`; the cookbook's model table does not know SmolLM2), (2) points `datasets.load_dataset` at local
data (sl_loop: the cookbook's own `example_data/conversations.jsonl`; rl_loop: a GSM8K-shaped file of
arithmetic problems this script writes, no download), (3) gives rl_loop `loss_fn=importance_sampling` (its
default `stable_reinforce` is not served), and small sizes for a CPU server. Any `key=value` after the loop's
name is passed to the recipe's own chz entry point and wins over these defaults.

Install, from the repository's root, in one step: `scripts/setup-cookbook` (an overlay venv, runs/cookbook-venv,
git-ignored, on top of the project's .venv; the versions of constraints-cookbook.txt; tml-renderers>=0.4.1, which
the wheel requires, is not on PyPI, and the text renderers do not need it).

Run, with a server on :8000 (`GRPO_SERVER_API_KEY=$KEY .venv/bin/grpo-server serve --config configs/server.yaml`;
--hf-home makes the tokenizer's offline HF cache there):

    export TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-$KEY
    runs/cookbook-venv/bin/python examples/tinker_cookbook.py sl --hf-home runs/tk-hf log_path=runs/tk-sl
    runs/cookbook-venv/bin/python examples/tinker_cookbook.py rl --hf-home runs/tk-hf log_path=runs/tk-rl

Each loop writes `<log_path>/metrics.jsonl` (sl: `train_mean_nll`; rl: `reward/total`). A rerun with the same
`log_path` resumes from its `checkpoints.jsonl`. docs/guides/tinker.md has the guide; on a shared 2-core box these
defaults took minutes (sl) to about ten minutes (rl).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

# This file's name is the package's: drop its folder from the path so that `import tinker_cookbook` is the cookbook.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
LOCAL_MODEL = Path.home() / ".cache/grpo_server/models/smollm2-135m-instruct"
RENDERER = "qwen3_instruct"
DEFAULTS = {
    "sl": {"model_name": MODEL, "lora_rank": "16", "batch_size": "16", "max_steps": "8"},
    "rl": {"model_name": MODEL, "lora_rank": "16", "batch_size": "8", "group_size": "8", "max_tokens": "64",
           "max_steps": "10", "loss_fn": "importance_sampling"},
}


def make_hf_cache(hf_home: Path, model_dir: Path = LOCAL_MODEL, name: str = MODEL) -> None:
    """The Hugging Face cache layout for `name`, linking to the embedded model's files (docs/guides/tinker.md)."""
    repo = hf_home / "hub" / ("models--" + name.replace("/", "--"))
    rev = "0" * 40  # any 40-hex revision will do
    snapshot = repo / "snapshots" / rev
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors" and not f.name.startswith(".") and not (snapshot / f.name).exists():
            (snapshot / f.name).symlink_to(f)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(rev)


def write_arithmetic(path: Path, n: int = 512, seed: int = 0) -> None:
    """GSM8K-shaped rows: `question`, and `answer` ending in a `#### N` line (all rl_loop's reward reads).

    Operands 1-5: the 135M model rarely writes `\\boxed{}` at all (1 of 32 samples in a probe of these), and a group
    whose rewards are all equal trains nothing."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.randint(1, 5), rng.randint(1, 5)
            row = {"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
            f.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("loop", choices=["rl", "sl"])
    parser.add_argument("--hf-home", type=Path, help="make the offline tokenizer cache here (sets HF_HOME)")
    parser.add_argument("--data", type=Path, help="a local JSONL instead of the default data")
    args, chz_args = parser.parse_known_args()

    if args.hf_home:  # before transformers / huggingface_hub are imported: they read these at import
        make_hf_cache(args.hf_home)
        os.environ["HF_HOME"] = str(args.hf_home)
        os.environ["HF_HUB_OFFLINE"] = "1"

    import chz
    import datasets

    import tinker_cookbook
    from tinker_cookbook import model_info

    data = args.data
    if data is None and args.loop == "sl":
        data = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    elif data is None:
        data = Path(tempfile.mkdtemp(prefix="tk-arith-")) / "arith.jsonl"
        write_arithmetic(data)

    # 1. The renderer: SmolLM2 is not in model_info's tables.
    recommended = model_info.get_recommended_renderer_name
    model_info.get_recommended_renderer_name = lambda name: RENDERER if "SmolLM2" in name else recommended(name)
    # 2. The data: whatever dataset the loop names, the local JSONL.
    load = datasets.load_dataset
    datasets.load_dataset = lambda *a, **k: load("json", data_files={"train": str(data)})

    if args.loop == "rl":
        from tinker_cookbook.recipes import rl_loop as loop
    else:
        from tinker_cookbook.recipes import sl_loop as loop
    given = {a.split("=", 1)[0] for a in chz_args}
    defaults = [f"{k}={v}" for k, v in DEFAULTS[args.loop].items() if k not in given]
    sys.argv = [sys.argv[0], *defaults, *chz_args]
    print(f"{args.loop}_loop: data {data}, renderer {RENDERER}, args {sys.argv[1:]}", flush=True)
    chz.nested_entrypoint(loop.main)


if __name__ == "__main__":
    main()
