# grpo_server on a CUDA host. One image for every process: docker-compose.yml runs it as the front end, one
# sampler per GPU and the learner (`grpo-server serve --role frontend|sampler|learner`); run alone, the
# default command starts all three in one container (`--role all`).
FROM python:3.11-slim
# g++ / ninja: DeepSpeed builds its ops on first use; curl: the compose health checks.
RUN apt-get update && apt-get install -y --no-install-recommends g++ ninja-build curl && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY grpo_server grpo_server
COPY sampler sampler
COPY learner learner
COPY configs configs
# The embedded model is prepared at build time, so no container downloads or converts anything at start.
RUN DS_BUILD_OPS=0 pip install --no-cache-dir -e ".[gpu]" && grpo-server model prepare
# 8000: the public API; 8101 / 8102: a sampler's and the learner's verbs (the compose network only).
EXPOSE 8000 8101 8102
CMD ["grpo-server", "serve", "--role", "all", "--config", "configs/server.yaml", "--host", "0.0.0.0", "--run-dir", "/runs"]
