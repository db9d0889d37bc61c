# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Figure 5: UPipe vs USP-Hybrid on 16 GPUs (8 Ulysses × 2 Ring), Llama3-8B
#
# Memory bars (left axis) and UPipe's throughput normalised to USP's (right axis). The paper's
# values were read off its figure by eye (±1 GiB).
#
# Rows: `python -m sweeps run sweeps/configs/fig5-multinode.yaml --executor slurm` (real);
# `python -m bench fidelity --anchors fig5- --out results/fidelity` (simulated at paper scale:
# yunchang's USP as the paper ran it, and ours for UPipe).

# %% tags=["parameters"]
RESULTS = None  # folder of result rows; None: the repository's results/

# %%
from analysis import figures, tables
from analysis.load import load_rows, modes_summary, results_dir

rows = load_rows(results_dir(RESULTS))
print(f"{len(rows)} rows; {modes_summary(rows)}")

# %%
tables.fig5_table(rows)

# %%
figures.fig5_plot(rows)
