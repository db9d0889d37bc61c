"""What every method shares, kept apart from the method files.

The registry, ``AttnSpec``, the ``AttentionMethod`` base class, the collectives (``comm``),
the attention kernels, RoPE, the sequence layouts (``layouts``: each shard/unshard pair
written once), the single-device reference, the host-memory stand-in for simulation
(``hostmem``) and the host chunk store of chunked methods (``chunkstore``).

``methods/__init__.py`` imports every module directly in ``methods/`` to run their
``@register`` decorators; keeping this infrastructure in a subpackage is what lets it do so
without a list of modules to skip, and lets a reader see at a glance which files in
``methods/`` are methods.
"""
