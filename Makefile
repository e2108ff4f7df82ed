# The two commands a fresh machine needs: `make run` (the main job) and `make test`.
# Both create .venv on first use and install it from the committed lock (envs/install.sh
# pipeline: requirements.lock, exact versions with hashes); `make lock` rewrites the locks
# from pyproject.toml.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RESULTS := results

.PHONY: run test lint format clean slurm-profile lock images

$(STAMP): pyproject.toml requirements.lock requirements-hpsv2.lock envs/install.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	PYTHON=$(BIN)/python envs/install.sh pipeline --editable
	touch $@

# Every requirements*.lock, resolved by uv for Linux x86_64 and Python 3.11 (the images, the
# clusters, CI) with the hashes of every file of each pinned release:
#   requirements.lock          pyproject.toml with its extras (torch's CUDA build, from PyPI)
#   requirements-cpu.lock      the same pins, torch and torchvision from PyTorch's CPU index
#   requirements-summary.lock  envs/summary.in at requirements.lock's versions
#   requirements-hpsv2.lock    envs/hpsv2.in, without dependencies
# A pin that still fits pyproject.toml stays; `make lock UPGRADE=1` moves every pin to the
# newest release within its bounds.
LOCK_FLAGS := --quiet --generate-hashes --python-version 3.11 \
	--python-platform x86_64-manylinux_2_28 --custom-compile-command "make lock" \
	$(if $(UPGRADE),--upgrade)
PINS := $(VENV)/lock-pins.txt
lock:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	test -x $(BIN)/uv || $(BIN)/pip install uv
	$(BIN)/uv pip compile $(LOCK_FLAGS) --all-extras pyproject.toml -o requirements.lock
# The pins alone (no hashes: those of torch's CPU build differ) constrain the other locks.
	sed -n 's/^\([A-Za-z0-9][^ ]*==[^ ]*\).*/\1/p' requirements.lock > $(PINS)
	$(BIN)/uv pip compile $(LOCK_FLAGS) --no-deps envs/hpsv2.in -o requirements-hpsv2.lock
	$(BIN)/uv pip compile $(LOCK_FLAGS) --constraint $(PINS) envs/summary.in \
	    -o requirements-summary.lock
	$(BIN)/uv pip compile $(LOCK_FLAGS) --constraint $(PINS) --torch-backend cpu --all-extras \
	    pyproject.toml -o requirements-cpu.lock

# The default experiment (config.yaml, target `all`) through the Snakemake workflow: the toy
# world build, rounds of rollout -> score -> train per variant, evaluations, the comparison
# page (every experiment target ends with it).
run: $(STAMP)
	$(BIN)/snakemake --profile workflow/profiles/local all
	$(BIN)/snakemake --profile workflow/profiles/local all --report $(RESULTS)/report.html
	@echo "results:    $(RESULTS)/all/<variant>/seed-<s>/ (round-*/, eval/trained-*/)"
	@echo "comparison: $(RESULTS)/comparison/all/index.html (read back from MLflow)"
	@echo "report:     $(RESULTS)/report.html (Snakemake's report: open it in a browser)"
	@echo "MLflow UI:  $(BIN)/mlflow ui --backend-store-uri sqlite:///$(RESULTS)/mlflow.db"
	@echo "            then open http://127.0.0.1:5000 (experiment jagg-toy)"

lint: $(STAMP)
	$(BIN)/ruff check jagg_pipeline tests benchmarks
	$(BIN)/ruff format --check jagg_pipeline tests benchmarks
	$(BIN)/snakefmt --check Snakefile workflow
	$(BIN)/snakemake --lint --cores 1

# Installs workflow/profiles/slurm where Snakemake looks up a bare profile name, so that
# `snakemake --profile slurm TARGET` works from the repository root:
#   make slurm-profile SLURM_ACCOUNT=my-account SLURM_PARTITION=gpu
# (both optional: empty means SLURM's defaults for your user).
SLURM_PROFILE := $(or $(XDG_CONFIG_HOME),$(HOME)/.config)/snakemake/slurm
slurm-profile:
	mkdir -p $(SLURM_PROFILE)
	sed -e 's|^  slurm_account: .*|  slurm_account: "$(SLURM_ACCOUNT)"|' \
	    -e 's|^  slurm_partition: .*|  slurm_partition: "$(SLURM_PARTITION)"|' \
	    workflow/profiles/slurm/config.yaml > $(SLURM_PROFILE)/config.yaml
	@echo "installed $(SLURM_PROFILE)/config.yaml (account '$(SLURM_ACCOUNT)', partition '$(SLURM_PARTITION)')"

# The Apptainer images of the stages and the comparison (containers/build.sh: a Debian 12 base,
# the locks' files from PyPI, then containers/pipeline.def and summary.def), as root with
# debootstrap (and bubblewrap where no apptainer is installed); cached in
# ~/.cache/jagg-pipeline/images by the digest of the locks and containers/. Prints each image's
# path and size; point workflow.containers at them.
#   make images            pipeline.sif and summary.sif, to copy to a cluster
#   make images SANDBOX=1  folders instead (no squashfs pass: what the tests use)
images:
	containers/build.sh $(if $(SANDBOX),--sandbox)

# pytest exits 5 when it collects nothing; make treats that as the failure it is.
# The suite runs on pytest-xdist workers, a test file per worker at a time, files that share a
# service together (tests/conftest.py); TEST_WORKERS=0 runs it in this process. One worker
# more than cores: the SLURM tests spend much of their time waiting on SLURM's status polls,
# and the extra worker uses those idle cores. --no-loadscope-reorder: the groups start in the
# order conftest.py gives them (the longest first), not by their number of tests.
TEST_WORKERS ?= $(shell echo $$(($$(nproc) + 1)))
test: lint
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup \
	    --no-loadscope-reorder

format: $(STAMP)
	$(BIN)/ruff format jagg_pipeline tests benchmarks
	$(BIN)/ruff check --fix jagg_pipeline tests benchmarks
	$(BIN)/snakefmt Snakefile workflow

clean:
	rm -rf $(VENV) $(RESULTS) .pytest_cache .ruff_cache
