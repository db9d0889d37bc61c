"""``python -m methods``: the registered methods, what they are and whether they run here.

``python -m methods --write-facts`` regenerates ``records/method_facts.json``, the table of every
method's facts (``@register(..., facts=...)``) that the torch-free analysis reads.
"""
from __future__ import annotations

import argparse

import methods
from methods.core.kernels import KERNELS, default_kernel_name
from methods.core.registry import write_facts_table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m methods", description=__doc__.splitlines()[0])
    parser.add_argument("--write-facts", action="store_true",
                        help="regenerate records/method_facts.json from the methods' registrations")
    args = parser.parse_args(argv)
    if args.write_facts:
        print(f"wrote {write_facts_table()}")
        return
    infos = methods.available(detail=True)
    width = max(len(i.name) for i in infos)
    status_width = max(len("usable here"), *(len(i.status) for i in infos))
    print(f"{'method':<{width}}  {'usable here':<{status_width}}  description")
    for info in infos:
        print(f"{info.name:<{width}}  {info.status:<{status_width}}  {info.description}")
    print(f"\nattention kernels: {', '.join(KERNELS)} (default here: {default_kernel_name()})")


if __name__ == "__main__":
    main()
