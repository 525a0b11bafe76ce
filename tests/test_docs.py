"""The documentation: the MkDocs site builds with --strict (no broken link or anchor), its generated reference
holds every config field, route, loss and metric, the README stays a short front page, and every shell or Python
block of the README and the docs is run by a test or says why not. The blocks marked `run:` that need a server
run here against the tiny-model test server (the session's `server` fixture)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
SNIPPET_LANGUAGES = {"bash", "sh", "shell", "console", "python", "py", "python3"}
MARK = re.compile(r"^<!-- (run: (?P<test>tests/[\w/]+\.py::\w+)|not run: (?P<reason>.+\S)) -->$")


def documents() -> list[Path]:
    """Every Markdown file of the docs and the root pages a reader lands on."""
    return [README, REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[tuple[int, str, str, str]]:
    """(line, language, the comment line before it, code) of each fenced block."""
    found, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        match = re.match(r"^```(\S*)\s*$", lines[i])
        if match:
            start, language = i, match.group(1)
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            found.append((start + 1, language, before, "\n".join(lines[start + 1:end]) + "\n"))
            i = end
        i += 1
    return found


def marked_block(path: Path, test: str) -> str:
    """The block marked `<!-- run: tests/test_docs.py::<test> -->` in `path`."""
    wanted = [code for _, _, before, code in blocks(path) if before == f"<!-- run: tests/test_docs.py::{test} -->"]
    assert len(wanted) == 1, f"{path.name}: {len(wanted)} blocks marked for {test}"
    return wanted[0]


# --- the site ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(REPO / "mkdocs.yml"),
                             "-d", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def test_the_site_builds_strict_with_every_page(site):
    assert (site / "index.html").is_file()
    for page in ("reference/configuration", "reference/http-api", "reference/losses", "reference/metrics",
                 "reference/cli", "reference/python-client", "benchmarks/summary", "contributing", "changelog",
                 "architecture/follow-a-request"):
        assert (site / page / "index.html").is_file(), page


def test_the_reference_has_every_config_field(site):
    from grpo_server.config import ExperimentConfig, ServerConfig
    from scripts.docs_reference import config_fields

    page = (site / "reference/configuration/index.html").read_text()
    for model in (ServerConfig, ExperimentConfig):
        fields = config_fields(model)
        assert len(fields) > 10
        missing = [dotted for dotted, _, _ in fields if f"<code>{dotted}</code>" not in page]
        assert not missing, f"{model.__name__} fields missing from the configuration reference: {missing}"
    assert "<code>algorithm.clip_low</code>" in page and "<code>sampler.cpu_lora_ops</code>" in page
    assert re.search(r"<code>sampler.block_size</code></td>\s*<td>[^<]*</td>\s*<td>[^<]*</td>\s*"
                     r"<td>\[16, 256\]; a multiple of 16</td>", page)


def test_the_reference_has_every_route(site):
    from grpo_server.api.app import ENDPOINTS

    page = (site / "reference/http-api/index.html").read_text()
    missing = [f"{e.method} {e.path}" for e in ENDPOINTS
               if not re.search(rf"<td>{e.method}</td>\s*<td><code>{re.escape(e.path)}</code></td>", page)]
    assert not missing, f"routes missing from the HTTP reference: {missing}"


def test_the_reference_has_every_loss_and_metric(site):
    from grpo_server.protocol.loss_table import LOSSES
    from scripts.docs_reference import metric_families

    losses = (site / "reference/losses/index.html").read_text()
    assert not [name for name in LOSSES if f"<code>{name}</code>" not in losses]
    metrics = (site / "reference/metrics/index.html").read_text()
    names = [name for name, _, _, _ in metric_families()]
    assert "grpo_mismatch_kl_fresh" in names and "grpo_offpolicy_kl_stale" in names
    assert not [name for name in names if f"<code>{name}</code>" not in metrics]


def test_the_reference_has_every_command_and_client_method(site, tmp_path):
    import inspect

    from grpo_server.client import AsyncClient, Client
    from scripts.docs_reference import write_pages

    cli = (site / "reference/cli/index.html").read_text()
    for command in ("grpo-server", "grpo-server serve", "grpo-server plot", "grpo-server export",
                    "grpo-server model", "grpo-server model prepare"):
        assert f"><code>{command}</code><a class=\"headerlink\"" in cli, command
    assert "--run-dir" in cli and "--merged" in cli
    client = (site / "reference/python-client/index.html").read_text()
    for cls in (Client, AsyncClient):
        methods = [name for name, _ in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")]
        assert len(methods) >= 15
        missing = [name for name in methods if f'id="grpo_server.client.{cls.__name__}.{name}"' not in client]
        assert not missing, f"{cls.__name__} methods missing from the client reference: {missing}"
    # Without MkDocs: the same pages written by the module the hook calls.
    written = {path.relative_to(tmp_path).as_posix() for path in write_pages(tmp_path)}
    assert {"reference/cli.md", "reference/configuration.md", "reference/http-api.md"} <= written


def test_the_generated_pages_are_not_committed():
    """Generated into the build only, so they can never be stale: none of them is a file in docs/."""
    from scripts.docs_reference import PAGES

    assert not [path for path in PAGES if (REPO / "docs" / path).exists()]


# --- the README --------------------------------------------------------------------------------------------


def test_the_readme_is_a_short_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    hashes = [word for word in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"[a-f]", word)
              and re.search(r"\d", word)]
    assert not hashes, f"commit hashes in the README: {hashes}"
    dates = re.findall(r"\b(?:19|20)\d\d-\d\d-\d\d\b|\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]* "
                       r"\d{1,2},? (?:19|20)\d\d\b", text)
    assert not dates, f"dates in the README: {dates}"
    for heading in ("## Two commands", "## Use it", "## Install", "## APIs", "## Map", "## Documentation"):
        assert heading in text


def test_the_readme_links_resolve():
    text = README.read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if target.startswith(("http://", "https://")):
            continue
        assert (REPO / target).exists(), f"README links to {target}, which does not exist"


def test_the_readme_keeps_the_two_commands():
    code = "".join(code for _, language, _, code in blocks(README) if language == "bash")
    assert "scripts/demo " in code and "scripts/test " in code
    assert os.access(REPO / "scripts/demo", os.X_OK) and os.access(REPO / "scripts/test", os.X_OK)


# --- snippets: run, or marked as not run ---------------------------------------------------------------------


def test_every_snippet_is_run_or_says_why_not():
    unmarked, unknown = [], []
    for path in documents():
        for line, language, before, _ in blocks(path):
            if language not in SNIPPET_LANGUAGES:
                continue
            match = MARK.match(before)
            where = f"{path.relative_to(REPO)}:{line}"
            if match is None:
                unmarked.append(where)
            elif match.group("test"):
                file, name = match.group("test").split("::")
                source = REPO / file
                if not source.is_file() or not re.search(rf"^(async )?def {name}\(", source.read_text(), re.M):
                    unknown.append(f"{where} -> {match.group('test')}")
    assert not unmarked, ("blocks with neither `<!-- run: tests/FILE.py::TEST -->` nor `<!-- not run: REASON -->` "
                          f"before them: {unmarked}")
    assert not unknown, f"blocks marked as run by a test that does not exist: {unknown}"


def _named(code: str, name: str) -> str:
    for old in ('"demo"', '"alphabetize"', '"sorting"', "/demo/"):
        code = code.replace(old, old.replace(old.strip('"/'), name))
    return code


async def _delete(server, name: str) -> None:
    from grpo_server.client import AsyncClient

    async with AsyncClient(server.url, server.api_key) as client:
        await client.delete_experiment(name)


async def test_readme_curl_block_runs(server):
    name = f"docs-curl-{uuid.uuid4().hex[:6]}"
    code = _named(marked_block(README, "test_readme_curl_block_runs"), name).replace(
        "URL=http://localhost:8000", f"URL={server.url}")
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "GRPO_SERVER_API_KEY": server.api_key})
    try:
        assert result.returncode == 0, result.stderr[-2000:]
        assert '"scored_version"' in result.stdout or '"group_id"' in result.stdout, result.stdout[-2000:]
        assert '"error"' not in result.stdout, result.stdout[-2000:]
    finally:
        await _delete(server, name)


def _run_python(code: str, server, **scope) -> dict:
    code = code.replace('"http://127.0.0.1:8000"', repr(server.url)).replace(
        '"my-admin-key-change-me"', repr(server.api_key))
    namespace = {"__name__": "docs_snippet", **scope}
    exec(compile(code, "snippet", "exec"), namespace)  # noqa: S102 - the docs' own code
    return namespace


async def test_readme_python_block_runs(server):
    import asyncio

    name = f"docs-py-{uuid.uuid4().hex[:6]}"
    code = _named(marked_block(README, "test_readme_python_block_runs"), name)
    try:
        await asyncio.to_thread(_run_python, code, server)  # the blocking Client runs its own loop
    finally:
        await _delete(server, name)


async def test_quickstart_python_block_runs(server):
    import asyncio

    name = f"docs-qs-{uuid.uuid4().hex[:6]}"
    code = _named(marked_block(REPO / "docs/quickstart.md", "test_quickstart_python_block_runs"), name)
    try:
        scope = await asyncio.to_thread(_run_python, code, server)
        assert scope["status"].counters.groups_received == 2
    finally:
        await _delete(server, name)


async def test_openai_guide_block_runs(server):
    import asyncio

    from grpo_server.client import AsyncClient

    name = f"docs-oai-{uuid.uuid4().hex[:6]}"
    async with AsyncClient(server.url, server.api_key) as client:
        await client.create_experiment({"name": name, "sampling": {"max_tokens": 8}})
    code = _named(marked_block(REPO / "docs/guides/openai.md", "test_openai_guide_block_runs"), name).replace(
        '"http://127.0.0.1:8000/v1"', repr(server.url + "/v1"))
    try:
        scope = await asyncio.to_thread(_run_python, code, server, api_key=server.api_key)
        assert len(scope["rewards"]) == 4
    finally:
        await _delete(server, name)


def test_benchmarks_md_is_the_generated_summary_and_its_commands():
    """BENCHMARKS.md holds the tables scripts/bench writes between their markers (each once: the summary's and the
    extra figures'), the commands, and no dated narratives (their conclusions are docs/benchmarks/findings.md)."""
    from scripts.benchmarks.table import EXTRA, markers

    outside = (REPO / "BENCHMARKS.md").read_text()
    for name in (None, *EXTRA):
        start, end = markers(name)
        if name is not None and start not in outside:
            continue  # an extra figure not run yet
        assert outside.count(start) == 1 and outside.count(end) == 1, name
        outside = outside.split(start)[0] + outside.split(end)[1]
    assert len(outside.splitlines()) <= 60 and "## Commands" in outside
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", outside)


# --- the Tinker guide (docs/guides/tinker.md): its tokenizer and SDK blocks ----------------------------------
TINKER_GUIDE = REPO / "docs/guides/tinker.md"
EMBEDDED_MODEL = Path.home() / ".cache/grpo_server/models/smollm2-135m-instruct"  # as examples/tinker_cookbook.py


@pytest.mark.slow
def test_tinker_guide_tokenizer_block_runs(tmp_path):
    """Step 3: the offline cache from the embedded model's files, in which transformers finds the tokenizer by its
    hub name with the hub off, as the SDK's get_tokenizer() asks for it. Run in a scratch folder (its runs/)."""
    if not (EMBEDDED_MODEL / "tokenizer.json").is_file():
        pytest.skip(f"the embedded model is not prepared in {EMBEDDED_MODEL} (scripts/setup prepares it)")
    code = marked_block(TINKER_GUIDE, "test_tinker_guide_tokenizer_block_runs")
    (tmp_path / "examples").symlink_to(REPO / "examples")
    check = ('"$PYTHON" -c \'from transformers import AutoTokenizer; '
             'print(AutoTokenizer.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct").encode("Hello world"))\'')
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HF_HUB_OFFLINE")} | {"PYTHON": sys.executable}
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", code.replace(".venv/bin/python", '"$PYTHON"') + check],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "runs/tk-hf/hub/models--HuggingFaceTB--SmolLM2-135M-Instruct/refs/main").is_file()
    assert len(json.loads(result.stdout.strip())) >= 2, result.stdout


def test_tinker_guide_sdk_block_runs(server, tiny_model_dir):
    """Step 4, as written, in a fresh interpreter with the environment of step 2 for the test server, whose base
    model (its Tinker name) is the tiny model's folder, where the SDK's get_tokenizer() finds the tokenizer too."""
    from grpo_server.client import Client

    code = marked_block(TINKER_GUIDE, "test_tinker_guide_sdk_block_runs")
    assert code.count('"HuggingFaceTB/SmolLM2-135M-Instruct"') == 1
    code = code.replace('"HuggingFaceTB/SmolLM2-135M-Instruct"', repr(str(tiny_model_dir)))
    env = {**os.environ, "TINKER_BASE_URL": server.url, "TINKER_API_KEY": f"tml-{server.api_key}",
           "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1"}
    with Client(server.url, server.api_key) as client:
        before = {e.name for e in client.list_experiments()}
        try:
            result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                                    timeout=300, env=env)
        finally:
            for name in {e.name for e in client.list_experiments()} - before:  # the model's experiment goes
                client.delete_experiment(name)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    loss = next(line for line in result.stdout.splitlines() if line.startswith("loss:sum"))
    assert float(loss.split()[1]) > 0, result.stdout
    print(result.stdout)  # the loss, and what the trained weights sampled


# --- pointers in user-facing text ------------------------------------------------------------------------------
# "README, Agents", "(README)", "README 'bf16 learner'": the README's sections moved into the docs site.
README_POINTER = re.compile(r"""README(?:[,:)]| ["']|'s )""")


def test_user_facing_pointers_name_pages_that_exist():
    """The generated reference (the config and route descriptions), configs/*.yaml, the compose files, the examples
    and the code of the three processes (its errors and docstrings) point at docs pages, not at README sections, and
    every docs/...md they name exists."""
    from scripts.docs_reference import PAGES

    texts = {f"generated {path}": render() for path, render in PAGES.items()}
    for path in [*sorted(REPO.glob("configs/*.yaml")), *sorted(REPO.glob("docker-compose*.yml")),
                 *sorted(REPO.glob("examples/*.py")),
                 *(path for package in ("grpo_server", "sampler", "learner")
                   for path in sorted(REPO.glob(f"{package}/**/*.py")))]:
        texts[str(path.relative_to(REPO))] = path.read_text()
    readme = [f"{where}: ...{text[max(0, m.start() - 60):m.end() + 20]!r}"
              for where, text in texts.items() for m in README_POINTER.finditer(text)]
    assert not readme, f"pointers to README sections: {readme}"
    missing = sorted({f"{where}: {page}" for where, text in texts.items()
                      for page in re.findall(r"\bdocs/[\w/.-]+?\.md\b", text) if not (REPO / page).is_file()})
    assert not missing, f"pointers to docs pages that do not exist: {missing}"
