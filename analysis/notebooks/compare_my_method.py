# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Compare my method
#
# Set `METHOD` to the name your method registered with (`python -m methods` lists them), run
# its sweep (see docs/adding-a-method.md), then run this notebook. It loads every row, shows
# your method's rows, and puts it next to every other method on the same model and world
# size: max context, throughput and peak memory at each sequence length, each row labelled
# with its mode (real / emulated / simulated) and device. Rows of different modes or devices
# are not comparable number for number.

# %% tags=["parameters"]
METHOD = "upipe"  # the method to compare
RESULTS = None  # folder of result rows; None: the repository's results/
RUNS = None  # folder(s) of your own rows, read beside RESULTS; None: runs/ ($CPAB_RUNS) where it exists
MODEL = None  # e.g. "llama3-8b"; None: the model of METHOD's rows (all, if it has none)
WORLD_SIZE = None  # e.g. 8; None: the world size of METHOD's rows
SCOPE = None  # "model" or "attention"; None: both

# %%
from analysis import tables
from analysis.load import load_rows, modes_summary, results_dir, user_dirs

rows = load_rows(results_dir(RESULTS), user_dirs=user_dirs(RUNS))
mine = rows[rows["method"] == METHOD] if len(rows) else rows
print(f"{len(rows)} rows in all; {len(mine)} of {METHOD!r}: {modes_summary(mine)}")

# %%
columns = ["label", "model", "scope", "seq", "world_size", "mode_label", "status", "tokens_per_s_per_device",
           "mem_gib", "max_context", "source_file"]
mine[[c for c in columns if c in mine.columns]]

# %% [markdown]
# The filters default to where your method has rows, so the table compares like with like.

# %%
model = MODEL or (mine["model"].mode().iloc[0] if len(mine) else None)
world_size = WORLD_SIZE or (int(mine[mine["model"] == model]["world_size"].mode().iloc[0]) if len(mine) else None)
print(f"comparing on model={model}, world_size={world_size}, scope={SCOPE or 'any'}")
tables.compare_methods(rows, model=model, world_size=world_size, scope=SCOPE, highlight=METHOD)

# %%
tables.compare_methods(rows, metric="mem_gib", model=model, world_size=world_size, scope=SCOPE, highlight=METHOD)
