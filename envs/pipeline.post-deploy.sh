#!/usr/bin/env bash
# Snakemake runs this in the conda env of envs/pipeline.yaml once it is created, from a copy
# beside the env: the package the yaml installed (editable) says where the repository is.
set -euo pipefail
root="$(python -c 'import jagg_pipeline, pathlib; print(pathlib.Path(jagg_pipeline.__file__).resolve().parents[1])')"
PYTHON=python exec bash "$root/envs/install.sh" pipeline --editable
