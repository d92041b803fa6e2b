# Set-up and everyday commands. Each creates .venv when missing, installs torch first (TORCH_SPEC,
# from TORCH_INDEX when set) and then this package in editable mode with its dev extras.
#
#   make quickstart                    # train, evaluate and sample a small GPT on Shakespeare (CPU)
#   make test                          # the test suite
#   make flags-doc                     # regenerate docs/flags.md from the argument parser
#   make TORCH_SPEC='torch==2.7.1' TORCH_INDEX=https://download.pytorch.org/whl/cu128 install
#
# A TORCH_SPEC or TORCH_INDEX given on the command line reinstalls torch in the existing .venv,
# and is remembered (.venv/.torch-choice) for the commands after it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_CHOICE := $(VENV)/.torch-choice
RECORDED_CHOICE := $(shell cat $(TORCH_CHOICE) 2>/dev/null)
TORCH_SPEC ?= $(or $(word 1,$(RECORDED_CHOICE)),torch==2.13.0)
TORCH_INDEX ?= $(word 2,$(RECORDED_CHOICE))
# Reinstalling with the same version from another index (a CPU build for a CUDA one) needs --force-reinstall.
TORCH_INSTALL_ARGS := $(if $(TORCH_INDEX),--force-reinstall --index-url $(TORCH_INDEX),)

.PHONY: install quickstart test flags-doc gpu-check clean-venv FORCE

# Rewritten only when the torch choice differs from the recorded one, so that a new choice
# (and only a new one) reruns the installation below.
$(TORCH_CHOICE): FORCE
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo '$(TORCH_SPEC) $(TORCH_INDEX)' | cmp -s - $@ || echo '$(TORCH_SPEC) $(TORCH_INDEX)' > $@

$(STAMP): $(TORCH_CHOICE) pyproject.toml requirements.txt
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_INSTALL_ARGS) "$(TORCH_SPEC)"
	$(PY) -m pip install -q "$(TORCH_SPEC)" -r requirements.txt
	touch $(STAMP)

install: $(STAMP)

quickstart: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash examples/quickstart.sh

test: $(STAMP)
	$(PY) -m pytest -q tests

flags-doc: $(STAMP)
	$(PY) tools/make_flags_doc.py --output docs/flags.md

clean-venv:
	rm -rf $(VENV)

# On a machine with a CUDA GPU, with the python at hand (no venv, no network): the tests marked
# gpu and compile, then the GPU benchmark at GPT 125M and 1.3B (docs/gpu.md). Without a GPU it
# says so and exits 0.
gpu-check:
	$(PYTHON) tools/gpu_check.py
