# The two set-up commands: `make quickstart` (the main job on the bundled default) and `make test`.
# Each creates .venv when missing and installs torch first (TORCH_SPEC), then requirements.txt.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: quickstart test test-fast clean-venv

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
