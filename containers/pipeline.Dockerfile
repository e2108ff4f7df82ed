# The stages' image (toyworld, rollout, score, train, evaluate): envs/pipeline.yaml as a
# container, torch and torchvision pinned by constraints.txt. From the repository root:
#   docker build -f containers/pipeline.Dockerfile -t jagg-pipeline:0.1.0 .
# For a GPU cluster the same pins pull CUDA wheels from PyPI; add the driver at run time
# (apptainer --nv, docker --gpus all).
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_DISABLE_TELEMETRY=1

WORKDIR /opt/jagg-pipeline
COPY constraints.txt pyproject.toml README.md ./
COPY jagg_pipeline ./jagg_pipeline
RUN pip install --no-cache-dir --constraint constraints.txt torch==2.14.1 torchvision==0.29.1 \
    && pip install --no-cache-dir --constraint constraints.txt .

ENTRYPOINT ["python", "-m", "jagg_pipeline"]
