"""Per-call overhead where blocks are small: ``ckptfx bench --overhead``, run from a checkout.

    python benchmarks/bench_overhead.py [--quick] [--only remat|split|vjp256] [--rounds N]

The benchmark ships in the package (``ckptfx/bench/overhead.py``, whose docstring says what
each part measures), so an installed ckptfx runs it too.
"""

from ckptfx.bench.overhead import main

if __name__ == "__main__":
    main()
