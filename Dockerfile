# Kiln's images: one Dockerfile, three targets (docker-compose.yml builds all three).
#
#   slim    the API, the webhook workers and the CLI: the base install, no torch.
#           docker build --target slim -t kiln:slim .
#   flower  slim plus Flower, pointed at Kiln's Celery app.
#           docker build --target flower -t kiln:flower .
#   worker  a GPU node: kiln[worker] on the CUDA build of torch from TORCH_INDEX_URL.
#           docker build --target worker -t kiln:worker \
#             --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# The checkout is turned into a wheel once (builder); the runtime stages install that wheel and
# nothing else of the source tree, so a container never installs anything when it starts. Every
# other package comes from the lock of its image (deploy/lock/: slim.txt, flower.txt, worker.txt,
# the versions `make test` ran on, each file checked against its hash, `--no-deps` so nothing
# outside the lock comes in); torch alone is the worker's own, from TORCH_INDEX_URL. They run
# as the unprivileged user `kiln` with `kiln` itself as PID 1 (exec-form ENTRYPOINT): SIGTERM
# reaches Celery's and uvicorn's own handlers, and a node drains (docs/operations.md §4).

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# ---- builder: the Kiln wheel ---------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# The build backend (setuptools, wheel) from the lock too: no unpinned build environment.
COPY deploy/lock/slim.txt /tmp/lock.txt
RUN pip install --require-hashes --no-deps -r /tmp/lock.txt
COPY pyproject.toml README.md ./
# kiln/ holds links to the three top-level folders: copy them side by side so the links resolve;
# the wheel then carries kiln/tasks, kiln/gpu_worker and kiln/storage as real files.
COPY kiln/ kiln/
COPY tasks/ tasks/
COPY gpu_worker/ gpu_worker/
COPY storage/ storage/
RUN pip wheel --no-deps --no-build-isolation --wheel-dir /wheels .

# ---- runtime: what every image shares ------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/kiln \
    PATH=/opt/kiln/bin:$PATH
# /models is created here, owned by kiln, so a named volume mounted there starts writable.
RUN groupadd --system --gid 10001 kiln \
    && useradd --system --uid 10001 --gid kiln --home-dir /home/kiln --create-home \
        --shell /usr/sbin/nologin kiln \
    && python -m venv /opt/kiln \
    && install -d -o kiln -g kiln /models
WORKDIR /home/kiln

# ---- slim: API, webhook workers, CLI (no torch) --------------------------------------------
FROM runtime AS slim
COPY deploy/lock/slim.txt /tmp/lock.txt
COPY --from=builder /wheels/ /tmp/wheels/
# The wheel's file name carries the version: take whichever the builder made. DL3013 (pin pip
# versions) is about registry names; this is the builder's wheel file, pinned by construction.
# hadolint ignore=DL3013
RUN set -- /tmp/wheels/kiln_queue-*.whl \
    && pip install --require-hashes --no-deps -r /tmp/lock.txt \
    && pip install --no-deps "$1" \
    && pip check \
    && rm -rf /tmp/wheels /tmp/lock.txt
USER 10001:10001
# Inside a container the API listens on every interface (the host decides what is published).
ENV KILN_API_HOST=0.0.0.0
EXPOSE 8000
# Liveness of the default command (`kiln api`); docker-compose.yml gives the API a /readyz check
# and the webhook worker its own.
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('KILN_API_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["kiln"]
CMD ["api"]

# ---- flower: Celery's monitor on Kiln's app ------------------------------------------------
FROM slim AS flower
USER 0:0
COPY deploy/lock/flower.txt /tmp/lock.txt
RUN pip install --require-hashes --no-deps -r /tmp/lock.txt \
    && pip check \
    && rm /tmp/lock.txt
USER 10001:10001
# Flower reads its options from FLOWER_* variables; the healthcheck reads the same port.
ENV FLOWER_PORT=5555
EXPOSE 5555
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthcheck' % os.environ.get('FLOWER_PORT', '5555'), timeout=4)"]
# `kiln.tasks.queue.celery_app` builds Kiln's Celery app from the KILN_* settings at import.
ENTRYPOINT ["celery", "-A", "kiln.tasks.queue.celery_app", "flower"]
# No arguments: slim's CMD (`api`) is not Flower's.
CMD []

# ---- worker: a GPU node --------------------------------------------------------------------
FROM runtime AS worker
# PyTorch's wheel index for the CUDA version the hosts' drivers support (cu126, cu128, ...).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TORCH_VERSION=2.13.0
# torch first, in its own layer (gigabytes; rebuilt only when these arguments change); the lock
# leaves it out, so nothing pulls another build. Its CUDA runtime comes as wheels;
# the NVIDIA container toolkit supplies the driver.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY deploy/lock/worker.txt /tmp/lock.txt
COPY --from=builder /wheels/ /tmp/wheels/
# DL3013: the builder's wheel file again; its extra's dependencies are the lock's.
# hadolint ignore=DL3013
RUN set -- /tmp/wheels/kiln_queue-*.whl \
    && pip install --require-hashes --no-deps -r /tmp/lock.txt \
    && pip install --no-deps "$1" \
    && pip check \
    && rm -rf /tmp/wheels /tmp/lock.txt
USER 10001:10001
# Kiln's model cache and the Hugging Face hub cache both live under /models: mount a volume
# there so a restart neither rebuilds nor downloads them again.
# Inside a container the node's metrics listen on every interface (Prometheus scrapes them from
# outside; the default, for a node run by hand, is loopback).
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    KILN_MODEL_CACHE=/models/kiln \
    HF_HOME=/models/huggingface \
    KILN_METRICS_HOST=0.0.0.0
EXPOSE 9400
# No image-level check: the node's check needs its --node-id (docker-compose.yml has it per node).
HEALTHCHECK NONE
ENTRYPOINT ["kiln"]
# Without --pipeline a worker only delivers webhooks: the default serves a model folder on /models.
CMD ["worker", "--devices", "cuda:0", "--pipeline", "default=diffusers:/models/default"]
