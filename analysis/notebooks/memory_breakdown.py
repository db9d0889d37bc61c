# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Fig. 1: peak memory breakdown, Llama3-8B, 3M tokens, 8 GPUs
#
# The ladder from FSDP (no context parallelism) and FSDP + Ulysses without levers up to UPipe
# with every lever (bench.stackmodel.fidelity.FIG1_RUNGS). Paper bars are hatched; ours are solid, split by
# the memory tracker's categories (model / activations / other) where the row has them
# (simulated and CPU rows), a single grey total otherwise (real CUDA rows); an OOM bar of ours
# is labelled with the GiB it would have needed.
#
# Rows: `python -m bench fidelity --anchors fig1- --out results/fidelity` (simulated, paper scale);
# `python -m sweeps run sweeps/configs/fig1-memory-breakdown-cpu.yaml --executor local` (CPU scale).

# %% tags=["parameters"]
RESULTS = None  # folder of result rows; None: the repository's results/

# %%
from analysis import figures, tables
from analysis.load import load_rows, modes_summary, results_dir

rows = load_rows(results_dir(RESULTS))
print(f"{len(rows)} rows; {modes_summary(rows)}")

# %%
tables.fig1_table(rows)

# %%
figures.fig1_plot(rows)
