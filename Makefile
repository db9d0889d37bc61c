# The two set-up commands of the README: `make demo` and `make test`.
# Both create .venv with pip when it is missing. torch is pinned in the same pip
# command as everything else so pip never resolves a multi-GB CUDA build on CPU.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
TORCH   ?= torch==2.13.0
EXTRAS  := dev,deepspeed,ring,notebooks
STAMP   := $(VENV)/.installed

.PHONY: demo test venv figs clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet "$(TORCH)" numpy -e ".[$(EXTRAS)]"
	touch $(STAMP)

test: $(STAMP)
	$(VPY) -m pytest -q

demo: $(STAMP)
	$(VPY) -m sweeps.demo

figs: $(STAMP)
	$(VPY) -m analysis figs

clean:
	rm -rf $(VENV)
