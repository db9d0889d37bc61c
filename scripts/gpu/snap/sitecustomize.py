"""Loaded by every Python process when this folder is on PYTHONPATH (scripts/gpu/validate.sh
phase `segments`): before the real trial's ``torch.cuda.empty_cache()`` releases the caching
allocator's segments, writes each segment's stream, mapped size and allocated size (from
``torch.cuda.memory_snapshot()``) and the allocator's peak counters to $SEGMENTS_OUT/<pid>.json.
With expandable segments a segment stays mapped at its largest size until empty_cache, so the
mapped sizes per stream are what each stream's pool reserved at the step's peak."""
import json
import os

import torch


def _dump_then(original):
    def empty_cache():
        if torch.cuda.is_available() and torch.cuda.memory_reserved() > 0:
            segs = [{"stream": s["stream"], "total_size": s["total_size"], "allocated_size": s["allocated_size"],
                     "active_size": s.get("active_size"), "segment_type": s.get("segment_type")}
                    for s in torch.cuda.memory_snapshot()]
            stats = {k: v for k, v in torch.cuda.memory_stats().items()
                     if k.startswith(("reserved_bytes.all", "allocated_bytes.all", "active_bytes.all",
                                      "num_alloc_retries", "num_ooms", "num_device"))}
            path = os.path.join(os.environ["SEGMENTS_OUT"], f"{os.getpid()}.json")
            with open(path, "w") as f:
                json.dump({"argv": os.environ.get("SEGMENTS_TAG"), "segments": segs, "stats": stats}, f)
        return original()
    return empty_cache


torch.cuda.empty_cache = _dump_then(torch.cuda.empty_cache)
