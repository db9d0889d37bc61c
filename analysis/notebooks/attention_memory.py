# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Attention-block memory and the U ablation
#
# One attention block, forward + backward, on C = 8 ranks: Ulysses against UPipe with
# U ∈ {C, 2C, 4C}, per-rank peak over the sequence length, and the memory UPipe saves against
# Ulysses next to the paper's 75% (Llama3-8B) and 87.5% (Qwen3-32B). The paper's numbers are
# the per-stage reduction of attention intermediates (1 − U/H); ours is the whole block's
# memory, so expect less.
#
# Rows: `python -m sweeps run sweeps/configs/attn-memory.yaml --executor local` (simulated, a
# few seconds per trial) and `python -m sweeps run sweeps/configs/u-ablation.yaml --executor slurm`.

# %% tags=["parameters"]
RESULTS = None  # folder of result rows; None: the repository's results/

# %%
from analysis import figures, tables
from analysis.load import load_rows, modes_summary, results_dir

rows = load_rows(results_dir(RESULTS))
print(f"{len(rows)} rows; {modes_summary(rows)}")

# %%
tables.attn_memory_table(rows)

# %%
figures.attn_memory_plot(rows)

# %% [markdown]
# ## U ablation: throughput and memory against the chunk size U (ours only)

# %%
tables.u_ablation_table(rows)

# %%
figures.u_ablation_plot(rows)
