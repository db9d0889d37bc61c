"""``python -m methods``: the registered methods, what they are and whether they run here."""
from __future__ import annotations

import methods
from methods.core.kernels import KERNELS, default_kernel_name


def main() -> None:
    infos = methods.available(detail=True)
    width = max(len(i.name) for i in infos)
    print(f"{'method':<{width}}  {'usable here':<24}  description")
    for info in infos:
        print(f"{info.name:<{width}}  {info.status:<24}  {info.description}")
    print(f"\nattention kernels: {', '.join(KERNELS)} (default here: {default_kernel_name()})")


if __name__ == "__main__":
    main()
