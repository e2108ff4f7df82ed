# The stages' image (toyworld, rollout, score, train, evaluate), installed from the lock by
# envs/install.sh like every other install. From the repository root:
#   docker build -f containers/pipeline.Dockerfile -t jagg-pipeline:0.1.0 .
# That is requirements.lock, torch's CUDA build from PyPI, for GPU clusters: add the driver at
# run time (apptainer --nv, docker --gpus all). The CPU image (tests, CPU-only machines) is
# requirements-cpu.lock, torch's CPU build:
#   docker build -f containers/pipeline.Dockerfile --build-arg FAMILY=pipeline-cpu \
#       -t jagg-pipeline-cpu:0.1.0 .
FROM python:3.11-slim-bookworm

# pipeline | pipeline-cpu (envs/install.sh)
ARG FAMILY=pipeline

ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_DISABLE_TELEMETRY=1

WORKDIR /opt/jagg-pipeline
COPY requirements*.lock pyproject.toml README.md ./
COPY envs/install.sh ./envs/
COPY jagg_pipeline ./jagg_pipeline
RUN envs/install.sh "$FAMILY"

ENTRYPOINT ["python", "-m", "jagg_pipeline"]
