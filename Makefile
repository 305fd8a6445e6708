# Two commands set up everything on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

# torch 2.14.1 + torchvision 0.29.1 is the pairing that imports together on the CPU-only
# dev/CI machines (PyPI's torchvision fails beside the CPU torch 2.13 wheel).
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

.PHONY: install demo test
install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mhla-diffusion demo --out outputs/demo

test: $(STAMP)
	$(VENV)/bin/pytest -q
