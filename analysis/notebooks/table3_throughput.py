# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Table 3: training throughput, paper vs ours
#
# Tokens/s per GPU for Llama3-8B on 8 GPUs and Qwen3-32B on 16 GPUs (the paper's Table 3),
# each method's throughput relative to Ulysses (the figure that compares across hardware),
# our CPU variants, and the same numbers drawn as curves.
#
# Rows: `python -m sweeps run sweeps/configs/table3-llama3-8b.yaml --executor slurm` (and
# `table3-qwen3-32b.yaml`); a CPU variant with `--executor local`. Missing cells are "—", never
# filled in; "fits" means the row ran but does not measure throughput (simulated mode).

# %% tags=["parameters"]
RESULTS = None  # folder of result rows; None: the repository's results/

# %%
from analysis import figures, tables
from analysis.load import load_rows, modes_summary, results_dir

rows = load_rows(results_dir(RESULTS))
print(f"{len(rows)} rows; {modes_summary(rows)}")

# %%
tables.table3(rows, "llama3-8b")

# %%
tables.table3(rows, "qwen3-32b")

# %%
tables.table3_ratios(rows)

# %%
tables.table3_cpu(rows)

# %%
figures.table3_plot(rows)
