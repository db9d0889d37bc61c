"""Context-parallel attention methods behind one interface.

    spec  = AttnSpec(dim=4096, n_heads=32, n_kv_heads=8, head_dim=128, causal=True)
    block = methods.build("upipe", spec, group=pg, chunk_heads=8)
    y_loc = block(block.shard(x, dim=1), positions=block.shard(torch.arange(S), dim=0))

Importing the package imports every module directly in ``methods/``, so each method's
``@register`` decorator runs: adding a method is adding one file here. What the methods share
(registry, base class, collectives, kernels, sequence layouts, ...) lives in the ``methods.core``
subpackage, which this loop leaves alone: every module directly in ``methods/`` is a method.
"""
from __future__ import annotations

import importlib
import pkgutil

from .core.comm import world
from .core.documents import Documents
from .core.registry import MethodInfo, all_infos, get_info, register, unregister
from .core.spec import AttnSpec

for _mod in pkgutil.iter_modules(__path__):
    if not _mod.ispkg and not _mod.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_mod.name}")


def available(detail: bool = False) -> list[str] | list[MethodInfo]:
    """Names of the methods usable here; ``detail=True``: every registered method's info."""
    if detail:
        return all_infos()
    return [info.name for info in all_infos() if info.usable]


def validate(
    name: str, spec: AttnSpec, world_size: int, *, provided: tuple[str, ...] = (), docs: Documents | None = None,
    **options,
) -> None:
    """Every check ``build`` makes, without a process group: unknown method, missing optional
    library, unknown option, violated constraint; with ``docs``, also that the method honours
    packed documents. Raises ``ValueError`` saying how to fix it.
    ``provided``: optional modules the caller will supply itself (bench's simulated mode supplies
    ``flash_attn``, ``bench.stackmodel.fake_flash_attn``), so their absence is not an error.
    """
    info = get_info(name)
    missing = info.missing(provided)
    if missing:
        hint = info.install_hint or f"pip install {' '.join(missing)}"
        raise ValueError(
            f"method {name!r} needs {', '.join(missing)}, which is not importable here; "
            f"install it ({hint}) or choose one of {available()}"
        )
    parsed = info.cls.parse_options(**options)
    info.cls.validate(spec, world_size, parsed)
    info.cls.check_documents(docs)
    if docs is not None:
        info.cls.validate_documents(spec, world_size, parsed, docs)


def build(name: str, spec: AttnSpec, group=None, **options):
    """Build method ``name`` for ``spec`` on ``group`` (None: one device) with typed options.

    All checks of ``validate`` run first, before any communication.
    """
    validate(name, spec, world(group)[0], **options)
    return get_info(name).cls(spec, group, **options)


__all__ = ["AttnSpec", "Documents", "MethodInfo", "available", "build", "get_info", "validate", "register",
           "unregister"]
