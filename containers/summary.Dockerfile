# The comparison's image (summary, track, compare): envs/summary.yaml as a container. No
# torch: matplotlib, PyYAML, MLflow and this package without its model dependencies.
# From the repository root:
#   docker build -f containers/summary.Dockerfile -t jagg-pipeline-summary:0.1.0 .
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /opt/jagg-pipeline
COPY constraints.txt pyproject.toml README.md ./
COPY jagg_pipeline ./jagg_pipeline
RUN pip install --no-cache-dir --constraint constraints.txt matplotlib pyyaml 'mlflow>=3,<4' blake3 \
    && pip install --no-cache-dir --no-deps .

ENTRYPOINT ["python", "-m", "jagg_pipeline"]
