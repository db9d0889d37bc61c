# The two set-up commands of the README: `make demo` and `make test`.
# Both create .venv with pip when it is missing. torch is pinned in the same pip
# command as everything else so pip never resolves a multi-GB CUDA build on CPU.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
TORCH   ?= torch==2.13.0
EXTRAS  := dev,deepspeed,ring,hf,yunchang,notebooks
STAMP   := $(VENV)/.installed

.PHONY: demo test test-fast lint venv figs figs-plans clean slurm-up slurm-down

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet "$(TORCH)" numpy -e ".[$(EXTRAS)]"
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# everything, lint included (what CI runs through .ci/run): two pytest-xdist workers, one per
# core, each running whole modules (tests/xdist_modules.py schedules by module)
XDIST   := -n 2 --dist loadscope

test: lint
	$(VPY) -m pytest -q $(XDIST) --durations=15

# the inner loop: no rank pools, sweeps, notebooks or Slurm (the `slow` marker, tests/conftest.py)
test-fast: $(STAMP)
	CPAB_NO_POOLS=1 $(VPY) -m pytest -q $(XDIST) -m "not slow"

demo: $(STAMP)
	$(VPY) -m sweeps.demo

figs: $(STAMP)
	$(VPY) -m analysis figs --out paper_figs

# figs, and the committed plans re-rendered from results/plan/sims.ndjson (no simulation; tens of seconds)
figs-plans: $(STAMP)
	$(VPY) -m analysis figs --out paper_figs --plans

# the single-node Slurm cluster the Slurm tests use (installed with apt and started as root)
slurm-up:
	bash scripts/slurm-up.sh

slurm-down:
	bash scripts/slurm-down.sh

clean:
	rm -rf $(VENV)
