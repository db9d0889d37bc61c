"""The correctness matrix and the worker-side check every method goes through.

Driven by ``methods.available()``: a method joins the matrix by registering. Extra option
variants per method live in ``variants``; a method not listed there runs with defaults.
A case the method refuses (``refusal``) is skipped with the method's reason, and a method
that refuses every case fails the matrix (``ran_none``): a run of skips proves nothing. The one
exemption is ``CUDA_ONLY``: methods with no CPU path at all, whose cases are skipped with that
reason and which must prove they refuse CPU input (``cpu_refusal``).

Packed documents (``DOC_LAYOUTS``, ``doc_cases``, ``check_documents_against_reference``): the
same methods, world sizes, specs, dtypes and option variants (plus ``doc_variants``: the sequence
layouts of the ring methods), each case checking its document layouts in one run on the ranks:
every layout at fp32, and at bf16 the two of ``DOC_LAYOUTS_BF16`` (``doc_layouts``).
A layout is data here: adding one needs no change to any method.
"""
from __future__ import annotations

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import methods
from methods.core.comm import all_reduce_sum_, world
from methods.core.reference import AttentionBlock

SEQ_LEN = 64  # divisible by 2*C*chunks for every layout at C <= 4
BATCH = 2
WORLD_SIZES = (1, 2, 4)

# name -> AttnSpec kwargs. "gqa-kv2" has fewer KV heads than ranks at C = 4 (replication).
SPECS = {
    "mha": dict(dim=64, n_heads=8, n_kv_heads=8, head_dim=16),
    "gqa": dict(dim=64, n_heads=8, n_kv_heads=4, head_dim=16),
    "gqa-kv2": dict(dim=64, n_heads=8, n_kv_heads=2, head_dim=16),
    "gqa-qknorm": dict(dim=48, n_heads=8, n_kv_heads=2, head_dim=8, qk_norm=True, rope_theta=1e6),
}

# Tolerances on max|a - b| / max|b| against the fp32 reference (TransformerEngine uses
# about 2.5e-2 for bf16 and 3.5e-2 with GQA; fp32 paths differ only by summation order).
TOLERANCE = {"float32": 2e-5, "bfloat16": 3.5e-2}

# Document layouts of the SEQ_LEN tokens (global lengths, in order). At C = 4 a shard holds 16
# tokens (ulysses, upipe) and FPDT's 2 chunks per rank are 8 tokens, zigzag's 2C chunks 8 too.
DOC_LAYOUTS = {
    "one": (64,),
    "many-short": (3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 3),  # single-token documents among them
    "shorter-than-shard": (6, 10, 7, 9, 12, 4, 8, 8),
    "crosses-every-shard": (2, 60, 2),
    "not-divisible-by-2C": (13, 11, 17, 23),
    "long-among-short": (3, 5, 40, 2, 7, 4, 3),
}
# specs the document matrix crosses: MHA and GQA
DOC_SPECS = ("mha", "gqa")
# The layouts a bf16 case of the document matrix checks. Where a layout puts which token, and which
# keys each query sees, does not depend on the dtype: the fp32 case with the same method, world size,
# spec, mask and options checks every layout at fp32's tolerance. What bf16 adds is the rounding of
# the attention and of the merges across ranks and documents, which these two reach at their edges:
# single-token documents (a row whose only key is itself) and documents that cross shards, and lengths
# not divisible by 2C (the padded per-document layouts).
DOC_LAYOUTS_BF16 = ("many-short", "not-divisible-by-2C")


def doc_layouts(dtype: str) -> dict[str, tuple[int, ...]]:
    """The document layouts a case of the document matrix checks at ``dtype``."""
    if dtype == "bfloat16":
        return {name: DOC_LAYOUTS[name] for name in DOC_LAYOUTS_BF16}
    return dict(DOC_LAYOUTS)


# Methods whose attention exists only as CUDA kernels, with no CPU path and no stand-in: the
# matrix (CPU gloo ranks) cannot run them. name -> where their correctness is checked instead.
# Their cases are skipped with this reason (``refusal``), ``test_every_method_ran_a_case`` says
# so instead of failing them, and ``test_cuda_only_methods_refuse_cpu`` checks that each one
# indeed refuses a CPU input with a one-line reason (an entry that ran on CPU would be an
# exemption for nothing, and fails that test).
CUDA_ONLY = {
    "torch-cp": "tests/methods/test_torch_cp.py (torch's ring on the CPU flash op on gloo ranks, the whole "
                "method on simulated CUDA, and against the reference on CUDA where a GPU is present)",
}


def variants(method: str, world_size: int, spec: dict) -> list[dict]:
    """Option sets to test for a method at a world size (deduplicated, defaults first)."""
    h = spec["n_heads"]
    table = {
        "upipe": [{}, {"chunk_heads": 2 * world_size}, {"chunk_heads": h}],
        "ring": [{}, {"layout": "contiguous"}],
        "usp": [{"ulysses_degree": u} for u in (world_size, 2, 1) if world_size % u == 0],
        "usp-upipe": [{"ulysses_degree": u} for u in (world_size, 2, 1) if world_size % u == 0]
        + ([{"ulysses_degree": 2, "chunk_heads": 4}] if world_size == 4 else []),
        "yc-usp": [{}] + [{"ulysses_degree": u} for u in (world_size, 2, 1) if world_size % u == 0],
        # defaults: 2 chunks, offload; chunk_tokens 16: K = SEQ_LEN / 16 = 4 chunks per rank
        # chunk_heads C: UPipe's head stages (one head per rank at a time) inside the chunk pipeline
        "fpdt": [{}, {"num_chunks": 1}, {"num_chunks": 4}, {"offload": False}, {"chunk_tokens": 16},
                 {"chunk_heads": world_size}],
        "offload": [{"what": "all"}, {"what": "attention"}],
    }
    out: list[dict] = []
    for v in table.get(method, [{}]):
        if v not in out:
            out.append(v)
    return out


def doc_variants(method: str, world_size: int, spec: dict) -> list[dict]:
    """Option sets the document matrix adds to ``variants``: the sequence layouts where they change
    which rank holds which part of which document (per-document head-tail, ``doc-zigzag``, padded
    where a length is not divisible; on USP's mesh with a ring of 2 as well)."""
    ring = [{"layout": "doc-zigzag"}]
    mesh = [{"ulysses_degree": u, "layout": "doc-zigzag"} for u in (1, 2) if world_size % u == 0 and world_size > u]
    table = {"ring": ring, "allgather-kv": ring, "usp": mesh, "usp-upipe": mesh}
    return [v for v in table.get(method, []) if v not in variants(method, world_size, spec)]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12)).item()


def check_against_reference(group, method: str, spec_kwargs: dict, options: dict, dtype: str) -> dict:
    """Run ``method`` and the reference on equal weights and inputs; relative errors by tensor.

    Weight gradients are per-rank partial sums (each rank sees its own tokens); they are
    summed over the group here, as FSDP/DDP would, before comparison, except for a method that
    splits no sequence (``splits_sequence`` False: each rank computed the full gradient).
    """
    torch.manual_seed(1234)
    dt = getattr(torch, dtype)
    spec = methods.AttnSpec(**spec_kwargs)
    block = methods.build(method, spec, group=group, **options)
    ref = AttentionBlock(spec, kernel="math")
    ref.load_state_dict(block.state_dict())
    block.to(dt)
    ref.load_state_dict({k: v.float() for k, v in block.state_dict().items()})  # same rounded weights
    return compare_with_reference(group, block, ref, dt)


def compare_with_reference(group, block, ref, dt: torch.dtype, docs: methods.Documents | None = None) -> dict:
    """One forward and backward of ``block`` and ``ref`` on fresh random input; relative errors by
    tensor. Without ``docs`` the positions are given (the layout's global ones); with ``docs``
    neither call gets positions, so both use the per-document ones."""
    x = torch.randn(BATCH, SEQ_LEN, block.spec.dim).to(dt)
    dy = torch.randn(BATCH, SEQ_LEN, block.spec.dim).to(dt)
    y_ref, dx_ref, ref_grads = reference_step(group, ref, x, dy, docs)

    if docs is None:
        x_loc = block.shard(x, dim=1).detach().clone().requires_grad_()
        pos = block.shard(torch.arange(SEQ_LEN), dim=0)
        y_loc = block(x_loc, positions=pos)
    else:
        x_loc = block.shard(x, dim=1, docs=docs).detach().clone().requires_grad_()
        y_loc = block(x_loc, docs=docs)
    assert y_loc.dtype == dt and y_loc.shape == x_loc.shape, (y_loc.dtype, y_loc.shape)
    y_loc.backward(block.shard(dy, dim=1, docs=docs))  # a layout may place tokens by document

    errors = {
        "out": rel_err(block.unshard(y_loc.detach(), dim=1, docs=docs), y_ref),
        "dx": rel_err(block.unshard(x_loc.grad, dim=1, docs=docs), dx_ref),
    }
    for name, grad in summed_grads(block, group).items():
        errors["d_" + name] = rel_err(grad, ref_grads[name])
    return errors


def summed_grads(block, group) -> dict[str, torch.Tensor]:
    """``block``'s weight gradients in fp32, by name, summed over the group as FSDP/DDP would (each rank's are
    partial sums over its own tokens), except for a method that splits no sequence (``splits_sequence``
    False: every rank has the whole gradient). One all-reduce of the flattened gradients, not one per
    parameter: the pool's ranks share the machine's cores, so each collective costs a round of wake-ups."""
    named = list(block.named_parameters())
    missing = [name for name, p in named if p.grad is None]
    assert not missing, f"no gradient for {missing}"
    grads = [p.grad.detach().float() for _, p in named]
    if block.splits_sequence:
        grads = _unflatten_dense_tensors(all_reduce_sum_(_flatten_dense_tensors(grads), group), grads)
    return {name: grad for (name, _), grad in zip(named, grads, strict=True)}


def reference_step(group, ref: AttentionBlock, x: torch.Tensor, dy: torch.Tensor,
                   docs: methods.Documents | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The fp32 reference's output, input gradient and weight gradients (by name) for the whole ``x`` and
    ``dy``: computed on the group's first rank and broadcast to the others, which hold the same ``ref``,
    ``x`` and ``dy`` (same seed, same weights), so every rank compares its own results with the same
    reference while only one computes it (the ranks of the test pool share the machine's cores, so a
    reference per rank multiplied its cost by the world size)."""
    size, rank = world(group)
    params = dict(ref.named_parameters())
    if rank == 0:
        x_ref = x.float().clone().requires_grad_()
        y_ref = ref(x_ref) if docs is None else ref(x_ref, docs=docs)
        y_ref.backward(dy.float())
        missing = [name for name, p in params.items() if p.grad is None]
        assert not missing, f"the reference has no gradient for {missing}"
        results = [y_ref.detach(), x_ref.grad, *(p.grad for p in params.values())]
    else:
        results = [torch.empty(x.shape), torch.empty(x.shape), *(torch.empty(p.shape) for p in params.values())]
    if size > 1:  # one broadcast of the flattened results rather than one per tensor
        flat = _flatten_dense_tensors(results)
        torch.distributed.broadcast(flat, src=torch.distributed.get_global_rank(group, 0), group=group)
        results = list(_unflatten_dense_tensors(flat, results))
    return results[0], results[1], dict(zip(params, results[2:], strict=True))


def check_documents_against_reference(
    group, method: str, spec_kwargs: dict, options: dict, dtype: str, layouts: dict[str, tuple[int, ...]]
) -> dict[str, dict]:
    """``check_against_reference`` with packed documents, for every layout in one run: the block
    and the reference are built once, and each layout gets fresh input and fresh gradients.
    Returns ``{layout: {tensor: relative error}}``."""
    torch.manual_seed(1234)
    dt = getattr(torch, dtype)
    spec = methods.AttnSpec(**spec_kwargs)
    block = methods.build(method, spec, group=group, **options)
    ref = AttentionBlock(spec, kernel="math")
    block.to(dt)
    ref.load_state_dict({k: v.float() for k, v in block.state_dict().items()})  # same rounded weights
    out = {}
    for name, lengths in layouts.items():
        block.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        out[name] = compare_with_reference(group, block, ref, dt, methods.Documents.from_lengths(lengths, SEQ_LEN))
    return out


def refusal(
    method: str, world_size: int, spec_kwargs: dict, options: dict, docs: methods.Documents | None = None
) -> str | None:
    """The method's own reason for refusing a case (``methods.validate``'s message), or None:
    the case runs. The one place the matrix decides whether a case runs or is skipped."""
    try:
        methods.validate(method, methods.AttnSpec(**spec_kwargs), world_size, docs=docs, **options)
    except ValueError as err:
        return str(err)
    if method in CUDA_ONLY:
        return f"{method} runs CUDA kernels only (no CPU path); its correctness is checked in {CUDA_ONLY[method]}"
    return None


def cpu_refusal(group, method: str, spec_kwargs: dict) -> str | None:
    """What ``method`` says when run on a CPU input (forward and backward): its error message,
    or None if it ran. For the ``CUDA_ONLY`` check; runs on the ranks like a matrix case."""
    block = methods.build(method, methods.AttnSpec(**spec_kwargs), group=group).bfloat16()
    x = torch.randn(BATCH, SEQ_LEN // world(group)[0], block.spec.dim, dtype=torch.bfloat16, requires_grad=True)
    try:
        block(x).sum().backward()
    except ValueError as err:
        return str(err)
    return None


def ran_none(method: str, refusals: list[str | None]) -> str | None:
    """The failure message when ``method`` refused every one of its cases, else None.

    ``refusals`` has one entry per case of ``method`` the matrix went through: its
    ``refusal`` (None where the case ran). Each refused case is a skip, and skips pass, so
    without this a method that refuses everything (a constraint too strict, a broken
    ``validate``) would look tested while nothing of it ran.
    """
    if not refusals or any(reason is None for reason in refusals):
        return None
    reasons = sorted(set(refusals))
    return (
        f"method {method!r} ran none of its {len(refusals)} correctness cases: it refused every one "
        f"({len(reasons)} distinct reason(s), e.g. {reasons[0]!r}); make it accept some case of "
        f"tests/methods/cases.py or add an option variant it accepts to variants()"
    )


def doc_cases(methods_list: list[str]):
    """The document matrix: every (method, ws, spec, causal, dtype, options) over ``DOC_SPECS``,
    each to be checked on ``doc_layouts(dtype)`` at once; ids start with ``docs-``."""
    import pytest

    for method in methods_list:
        for ws in WORLD_SIZES:
            for spec_name in DOC_SPECS:
                spec = SPECS[spec_name]
                for causal in (True, False):
                    for dtype in ("float32", "bfloat16"):
                        for opts in variants(method, ws, spec) + doc_variants(method, ws, spec):
                            opt_id = ",".join(f"{k}={v}" for k, v in opts.items()) or "default"
                            mask = "causal" if causal else "full"
                            yield pytest.param(
                                method, ws, dict(spec, causal=causal), opts, dtype,
                                id=f"docs-{method}-ws{ws}-{spec_name}-{mask}-{dtype}-{opt_id}",
                            )


def cases(methods_list: list[str]):
    """Every (method, ws, spec, causal, dtype, options) in the matrix, with a readable id."""
    import pytest

    for method in methods_list:
        for ws in WORLD_SIZES:
            for spec_name, spec in SPECS.items():
                for causal in (True, False):
                    for dtype in ("float32", "bfloat16"):
                        for opts in variants(method, ws, spec):
                            opt_id = ",".join(f"{k}={v}" for k, v in opts.items()) or "default"
                            yield pytest.param(
                                method, ws, dict(spec, causal=causal), opts, dtype,
                                id=f"{method}-ws{ws}-{spec_name}-{'causal' if causal else 'full'}-{dtype}-{opt_id}",
                            )
