# grpo_server on a CUDA host: front end, sampler(s) and learner in one container (`grpo-server serve`).
# Splitting them into separate compose services (a --role per process) is future work (issue 7).
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends g++ ninja-build curl && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY grpo_server grpo_server
COPY sampler sampler
COPY learner learner
COPY configs configs
RUN DS_BUILD_OPS=0 pip install --no-cache-dir -e ".[gpu]" && grpo-server model prepare
EXPOSE 8000
CMD ["grpo-server", "serve", "--config", "configs/server.yaml", "--host", "0.0.0.0", "--run-dir", "/runs"]
