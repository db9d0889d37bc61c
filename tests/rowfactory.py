"""The tests' one factory of synthetic result rows, built with ``records`` types.

``make_row`` takes the figures most tests care about in convenient units (``peak_gib``,
``tps``...) and any field of ``Row`` as a keyword (``figures=``, ``link=``, ``message=``...),
set after the convenient ones. The numbers are made up (they only have to be valid rows);
tests check where they land, never what they say about the methods.
"""
from __future__ import annotations

from records import Environment, Figures, GiB, KiB, MiB, Row, append_rows

K, M = KiB, MiB
PAPER_LEVERS = {"fsdp": True, "ac": True, "ac_offload": True, "offload_pin": True, "tiled_mlp": True,
                "mlp_tiles": 0, "chunked_loss": True, "loss_chunk": 2048, "lr": 3e-4}
LINK = {"name": "nvlink-h100", "intra_Bps": 450e9, "inter_Bps": 50e9, "latency_s": 1e-5, "ranks_per_node": 8,
        "description": "test link"}
ARCH = {"llama3-8b": dict(n_heads=32, n_kv_heads=8, head_dim=128),
        "qwen3-32b": dict(n_heads=64, n_kv_heads=8, head_dim=128),
        "tiny-llama": dict(n_heads=8, n_kv_heads=4, head_dim=16)}
DEVICE_NAMES = {"real": "NVIDIA H100 80GB HBM3", "emulated": "NVIDIA H100 80GB HBM3",
                "simulated": "fake tensors on test CPU (simulating h100-80g)"}


def make_row(method="upipe", model="llama3-8b", seq_len=128 * K, world_size=8, mode="real", status="ok",
             tps=None, peak_gib=None, reserved_gib=None, options=None, scope="model", levers=None,
             device="h100-80g", kind="trial", max_context=None, search=None, by_category=None,
             time="2026-11-20T00:00:00+00:00", device_name=None, message=None, **fields) -> Row:
    figs = Figures()
    if peak_gib is not None:
        figs.peak_bytes = int(peak_gib * GiB)
    if reserved_gib is not None:
        figs.peak_reserved_bytes = int(reserved_gib * GiB)
    if by_category is not None:
        figs.peak_by_category = {k: int(v * GiB) for k, v in by_category.items()}
    figs.tokens_per_device = seq_len // world_size if seq_len else None
    if tps is not None:
        figs.tokens_per_s_per_device = float(tps)
        figs.step_time_s = figs.tokens_per_device / tps
    if kind == "max_context":
        figs.max_context = max_context
    if message is None:
        message = "" if status == "ok" else {"oom": "CUDA out of memory", "error": "RuntimeError: boom"}[status]
    env = Environment(git_commit="0" * 40, git_dirty=False, torch="2.13.0", cuda=None, python="3.11",
                      libraries={}, device_name=device_name or DEVICE_NAMES.get(mode, "test device"), kernel="torch",
                      host="test",
                      time=time)
    row = Row(kind=kind, method=method, options=dict(options or {}), model=model, scope=scope, seq_len=seq_len,
              batch=1, world_size=world_size, mode=mode, dtype="bf16", device=device,
              levers=dict(PAPER_LEVERS if levers is None else levers),
              link=LINK if mode in ("emulated", "simulated") else None,
              search=search if kind == "max_context" else None, status=status, message=message,
              figures=figs, env=env, model_arch=dict(name=model, **ARCH.get(model, {})))
    for name, value in fields.items():
        if not hasattr(row, name):
            raise TypeError(f"make_row: Row has no field {name!r}")
        setattr(row, name, value)
    return row


def write(path, rows) -> None:
    append_rows(path, rows)
