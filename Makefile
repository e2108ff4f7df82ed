# The two commands a fresh machine needs: `make run` (the main job) and `make test`.
# Both create .venv on first use; every pip call goes through constraints.txt so that no
# later package can move the pinned torch/torchvision pair (DESIGN 8.1).

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install --constraint constraints.txt
STAMP := $(VENV)/.installed
RESULTS := results

.PHONY: run test lint format clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.14.1 torchvision==0.29.1
	$(PIP) --editable '.[dev]'
	# hpsv2 (a test reference only) pins protobuf<4 and old pytest: install it without deps.
	$(PIP) --no-deps hpsv2==1.2.0
	touch $@

TOYWORLD := $(RESULTS)/toyworld

# The toy world is built once; a finished build leaves its manifest (written last).
$(TOYWORLD)/sd3/manifest.json: | $(STAMP)
	$(BIN)/python -m jagg_pipeline toyworld build --out $(TOYWORLD) --backbone sd3

run: $(STAMP) $(TOYWORLD)/sd3/manifest.json
	$(BIN)/python -m jagg_pipeline gradcheck --backbone affine --trajectory chord \
		--dtype float64 --window 4 --json $(RESULTS)/gradcheck/affine_chord.json --max-rel-err 1e-10
	$(BIN)/python -m jagg_pipeline gradcheck --backbone mlp-dit --trajectory sde \
		--dtype float32 --window 4 --jagg-frac 0.6 --json $(RESULTS)/gradcheck/mlp-dit_sde.json
	$(BIN)/python -m jagg_pipeline experiment --out $(RESULTS)/experiment --rounds 3 \
		--modes exact jagg
	@echo "results: $(TOYWORLD) (toy world report, samples), $(RESULTS)/gradcheck,"
	@echo "         $(RESULTS)/experiment (rounds per mode, eval/ metrics and grids)"

lint: $(STAMP)
	$(BIN)/ruff check jagg_pipeline tests benchmarks
	$(BIN)/ruff format --check jagg_pipeline tests benchmarks

# pytest exits 5 when it collects nothing; make treats that as the failure it is.
test: lint
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest

format: $(STAMP)
	$(BIN)/ruff format jagg_pipeline tests benchmarks
	$(BIN)/ruff check --fix jagg_pipeline tests benchmarks

clean:
	rm -rf $(VENV) $(RESULTS) .pytest_cache .ruff_cache
