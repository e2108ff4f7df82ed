# The two commands a fresh machine needs: `make run` (the main job) and `make test`.
# Both create .venv on first use; every pip call goes through constraints.txt so that no
# later package can move the pinned torch/torchvision pair.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install --constraint constraints.txt
STAMP := $(VENV)/.installed
RESULTS := results

.PHONY: run test lint format clean slurm-profile

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.14.1 torchvision==0.29.1
	$(PIP) --editable '.[dev]'
	# hpsv2 (a test reference only) pins protobuf<4 and old pytest: install it without deps.
	$(PIP) --no-deps hpsv2==1.2.0
	touch $@

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

# pytest exits 5 when it collects nothing; make treats that as the failure it is.
test: lint
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest

format: $(STAMP)
	$(BIN)/ruff format jagg_pipeline tests benchmarks
	$(BIN)/ruff check --fix jagg_pipeline tests benchmarks
	$(BIN)/snakefmt Snakefile workflow

clean:
	rm -rf $(VENV) $(RESULTS) .pytest_cache .ruff_cache
