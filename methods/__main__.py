"""``python -m methods``: the registered methods, what they are and whether they run here."""
from __future__ import annotations

import methods
from methods.core.kernels import KERNELS, default_kernel_name


def main() -> None:
    infos = methods.available(detail=True)
    width = max(len(i.name) for i in infos)
    status_width = max(len("usable here"), *(len(i.status) for i in infos))
    print(f"{'method':<{width}}  {'usable here':<{status_width}}  description")
    for info in infos:
        print(f"{info.name:<{width}}  {info.status:<{status_width}}  {info.description}")
    print(f"\nattention kernels: {', '.join(KERNELS)} (default here: {default_kernel_name()})")


if __name__ == "__main__":
    main()
