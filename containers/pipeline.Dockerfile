# The stages' image (toyworld, rollout, encode, score, train, evaluate, bench) for a registry:
# the locks of containers/pipeline.def and this package, installed by envs/install.sh like
# every other install, so that the image also runs on its own. From the repository root:
#   docker build -f containers/pipeline.Dockerfile -t jagg-pipeline:0.1.0 .
#   containers/build.sh --docker pipeline     (buildah, FROM build.sh's Debian base, offline)
# That is requirements.lock, torch's CUDA build from PyPI, for GPU clusters: add the driver at
# run time (apptainer --nv, docker --gpus all). The CPU image (CPU-only machines) is
# requirements-cpu.lock, torch's CPU build:
#   docker build -f containers/pipeline.Dockerfile --build-arg FAMILY=pipeline-cpu \
#       -t jagg-pipeline-cpu:0.1.0 .
# BASE: any Debian 12 image with python3 (3.11) and its venv module.
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}

# pipeline | pipeline-cpu (envs/install.sh)
ARG FAMILY=pipeline
# pip's settings for the install alone; build.sh points them at its checked wheels.
ARG PIP_NO_INDEX
ARG PIP_FIND_LINKS

ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_DISABLE_TELEMETRY=1 \
    PATH=/opt/venv/bin:$PATH

WORKDIR /opt/jagg-pipeline
COPY requirements*.lock pyproject.toml README.md ./
COPY envs/install.sh ./envs/
COPY jagg_pipeline ./jagg_pipeline
RUN python3 -m venv /opt/venv && PYTHON=/opt/venv/bin/python envs/install.sh "$FAMILY"

ENTRYPOINT ["python", "-m", "jagg_pipeline"]
