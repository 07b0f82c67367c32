"""The tables of a ``ckptfx bench`` result: on the terminal, and as the README's markdown.

Both are read from the results dict (sweep.py) alone, so a saved ``results.json`` renders
the same tables as the run that wrote it.
"""

from __future__ import annotations

from typing import Any

from ckptfx._format import human_bytes
from ckptfx._term import table

__all__ = ["headline_rows", "markdown", "print_results"]

HEADER = ("variant", "peak memory", "memory vs none", "tokens/s", "tokens/s vs none",
          "gradients bitwise")


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{round(x * 100):+d}%"  # round(): no "-0%"


def headline_rows(results: dict[str, Any]) -> list[list[str]]:
    """One row per variant: peak, memory change, tokens/s, throughput change, parity."""
    rows = []
    for v in results["variants"]:
        saved = v["memory_saved"]  # None: the reference's peak rose by nothing
        rows.append([v["label"], human_bytes(v["peak_bytes"]),
                     _pct(None if saved is None else -saved), f"{v['tokens_per_s']:,.0f}",
                     _pct(v["tokens_per_s_change"]), "yes" if v["bitwise_equal"] else "NO"])
    return rows


def _shape(results: dict[str, Any]) -> str:
    c = results["config"]
    clock = " (step CPU time)" if results.get("clock") == "thread_cpu" else ""
    return (f"Llama-style decoder, {c['layers']} layers, dim {c['dim']}, {c['heads']} heads "
            f"({c['kv_heads']} kv), batch {c['batch']} x seq {c['seq']}, {c['device']}, "
            f"{c['threads']} thread(s){clock}")


def print_results(results: dict[str, Any]) -> None:
    """The headline table and the split replay counts, on stdout."""
    table(f"step on a {_shape(results)}: peak memory and throughput against no checkpoint",
          HEADER, headline_rows(results), right=(1, 2, 3, 4))
    s = results["split"]
    rows = [[str(k), f"{t:g}", f"{c:g}"]
            for k, t, c in zip(s["k"], s["torch_checkpoint"], s["ckptfx_session"])]
    table(f"split backward (dx + k dw calls): replays per block per micro-batch, counted "
          f"({s['blocks']} blocks; gradients bitwise equal to plain autograd: "
          f"{'yes' if s['bitwise_equal'] else 'NO'})",
          ("k dw calls", "torch checkpoint", "ckptfx session"), rows, right=(0, 1, 2))


def markdown(results: dict[str, Any]) -> str:
    """The headline table as GitHub markdown, with the shape and date line above it."""
    lines = [f"{_shape(results)}; medians; ckptfx {results['ckptfx']}, torch "
             f"{results['torch']}, {results['date']}, {results['machine']['cpu_count']} CPU "
             "cores", "", "| " + " | ".join(HEADER) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(HEADER))) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in headline_rows(results)]
    return "\n".join(lines) + "\n"
