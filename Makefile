# The two set-up commands: `make quickstart` (the main job on the bundled default) and `make test`.
# Each creates .venv when missing and installs torch first (TORCH_SPEC), then requirements.txt.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: quickstart test test-fast clean-venv gpu-check

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q "$(TORCH_SPEC)" -r requirements.txt
	touch $(STAMP)

quickstart: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash examples/quickstart.sh

test: $(STAMP)
	$(PY) -m pytest -q tests

clean-venv:
	rm -rf $(VENV)

# On a machine with a CUDA GPU, with the python at hand (no venv, no network): the tests marked
# gpu and compile, then the GPU benchmark at GPT 125M and 1.3B (docs/gpu.md). Without a GPU it
# says so and exits 0.
gpu-check:
	$(PYTHON) tools/gpu_check.py
