"""A trial's identity: the fields of a row that decide what was run, never what came out.

``trial_key`` is the one identity of the suite. A row has one, and so does a trial before it
runs (``bench.measure.trial.Trial.row_fields`` gives the same fields), so the sweeps decide
"already done" by comparing keys, and analysis keeps the newest row of each key.
"""
from __future__ import annotations

import json
from typing import Any

from .schema import Row
from .workloads import identity as docs_identity

# Method options under which a row records what a request was resolved to: a trial asked
# for ``chunk_heads="auto"`` writes the U it chose in ``chunk_heads`` and the request here.
REQUESTED_SUFFIX = "_requested"

# Schema 1 rows left a lever out of ``levers`` while it had its default (the levers added after
# the first rows were committed), and lack the levers schema 2 added: here is each such lever
# with the value an absent one means. ``trial_key`` reads every row as if it had written them,
# so a schema-1 row and a schema-2 row of the same configuration are the same trial. A lever
# added later goes here too, with the default its absence means in older rows.
V1_OMITTED_LEVERS: dict[str, Any] = {
    "kernel_workspace": "none", "tiled_mlp_impl": "ours", "chunked_loss_impl": "ours", "sim_device": "auto",
    "allocator_model": "none", "stack": "lean", "offload_keep": "first_last", "fsdp_offload": False,
    "fused_attn_norm": False, "rope_table": "auto", "ac_group": 1, "allocator_pools": "shared",
    "ring_barrier": False, "attention_math": "compute", "ac_keep_attn": False,
}


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def requested_options(options: dict) -> dict:
    """The method options as the trial asked for them: ``name_requested`` replaces ``name``."""
    out = dict(options)
    for key in [k for k in out if k.endswith(REQUESTED_SUFFIX)]:
        out[key[: -len(REQUESTED_SUFFIX)]] = out.pop(key)
    return out


def trial_key(row: Row | dict) -> tuple:
    """Hashable identity of the trial a row (or a trial's ``row_fields``) reports. A row with
    packed documents (``docs``) has their identity appended; a row without keeps the key it had
    before documents existed."""
    d = row.to_dict() if isinstance(row, Row) else row
    link = d.get("link")
    key = (
        str(d["kind"]), d["method"], _canon(requested_options(d.get("options") or {})), d["model"],
        str(d["scope"]), int(d["seq_len"]), int(d.get("batch", 1)), int(d["world_size"]), str(d["mode"]),
        str(d["dtype"]), d["device"], _canon({**V1_OMITTED_LEVERS, **(d.get("levers") or {})}),
        link["name"] if link else None,
        _canon(d.get("search")),
    )
    docs = d.get("docs")
    return key + (_canon(docs_identity(docs)),) if docs else key


def key_string(key: tuple) -> str:
    """A trial key as one string (the key of a sweep's jobs file)."""
    return _canon(list(key))
