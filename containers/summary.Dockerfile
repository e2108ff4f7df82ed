# The comparison's image (summary, track, compare): requirements-summary.lock (no torch:
# matplotlib, PyYAML, MLflow) and this package, installed by envs/install.sh like every other
# install. From the repository root:
#   docker build -f containers/summary.Dockerfile -t jagg-pipeline-summary:0.1.0 .
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /opt/jagg-pipeline
COPY requirements-summary.lock pyproject.toml README.md ./
COPY envs/install.sh ./envs/
COPY jagg_pipeline ./jagg_pipeline
RUN envs/install.sh summary

ENTRYPOINT ["python", "-m", "jagg_pipeline"]
