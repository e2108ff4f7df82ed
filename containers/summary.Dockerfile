# The comparison's image (summary, track, compare) for a registry: requirements-summary.lock
# (no torch: matplotlib, PyYAML, MLflow) and this package, installed by envs/install.sh like
# every other install. From the repository root:
#   docker build -f containers/summary.Dockerfile -t jagg-pipeline-summary:0.1.0 .
#   containers/build.sh --docker summary     (buildah, FROM build.sh's Debian base, offline)
# BASE, PIP_NO_INDEX and PIP_FIND_LINKS as in containers/pipeline.Dockerfile.
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}

ARG PIP_NO_INDEX
ARG PIP_FIND_LINKS

ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/venv/bin:$PATH

WORKDIR /opt/jagg-pipeline
COPY requirements-summary.lock pyproject.toml README.md ./
COPY envs/install.sh ./envs/
COPY jagg_pipeline ./jagg_pipeline
RUN python3 -m venv /opt/venv && PYTHON=/opt/venv/bin/python envs/install.sh summary

ENTRYPOINT ["python", "-m", "jagg_pipeline"]
