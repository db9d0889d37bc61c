# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Maximum context and peak memory per method
#
# The paper's max context per method is derived from Table 3 (the longest length that ran) plus
# Figure 5's text claim (UPipe 8M vs USP 6M on 16 GPUs). Ours come from max-context searches
# (`python -m sweeps run sweeps/configs/maxctx-llama3-8b.yaml --executor local`, and
# `maxctx-qwen3-32b.yaml`) and from the longest length our Table 3 rows ran without OOM.
# "≥" marks a lower bound.

# %% tags=["parameters"]
RESULTS = None  # folder of result rows; None: the repository's results/

# %%
from analysis import figures, tables
from analysis.load import load_rows, modes_summary, results_dir

rows = load_rows(results_dir(RESULTS))
print(f"{len(rows)} rows; {modes_summary(rows)}")

# %%
tables.max_context_table(rows)

# %%
figures.max_context_plot(rows)

# %% [markdown]
# Peak memory per GPU against sequence length on the Table 3 setups. The paper's per-method
# memory curves were not retrievable; only two 128K values (probably UPipe's) are known.

# %%
tables.memory_vs_seq_table(rows)

# %%
figures.memory_vs_seq_plot(rows)
