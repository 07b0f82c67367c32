"""The ``ckptfx`` command: version, help text, demo counts, residual reports of a user's block,
usage errors (exit 2, no traceback), and a tiny ``bench`` run writing its results and plots."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import ckptfx
from ckptfx import _term, cli
from ckptfx.bench import variants as bench_variants
from ckptfx.bench import write_outputs


@pytest.fixture
def plain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain-text output (what a machine without rich prints), with a fresh once-only hint."""
    monkeypatch.setenv("CKPTFX_PLAIN", "1")
    monkeypatch.setattr(_term, "_hinted", False)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == (
        f"ckptfx {ckptfx.__version__} (torch {torch.__version__})")


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["residuals", "--help"],
                                  ["bench", "--help"]])
def test_help_has_no_rst_markup(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: ckptfx")
    for markup in ("``", "::", ":func:", ":class:", ".. "):
        assert markup not in text, f"{markup!r} in {' '.join(argv)}"
    if argv[0] == "bench":
        assert "--quick" in text and "--out DIR" in text and "--tiny" not in text


def test_demo_counts(plain: None, capsys: pytest.CaptureFixture[str]) -> None:
    cli.main(["demo"])
    captured = capsys.readouterr()
    rows = {line[:24].strip(): line.split() for line in captured.out.splitlines()}
    # function runs, kept bytes (remat: human units), bitwise equal
    assert rows["no checkpoint"][-3:] == ["1", "-", "True"]
    assert rows["ckptfx.checkpoint"][-3:] == ["2", "-", "True"]
    for name in ("remat(nothing_saveable)", "remat(dots_saveable)"):
        assert rows[name][1] == "1" and rows[name][3] == "KiB" and rows[name][-1] == "True"
    split = [line.split() for line in captured.out.splitlines()
             if line.split()[:1] in (["1"], ["2"], ["4"])]
    # k dw calls, torch's replays (1 + k), ckptfx's (1), gradients bitwise equal
    assert split == [["1", "2", "1", "True"], ["2", "3", "1", "True"], ["4", "5", "1", "True"]]
    assert captured.err.count('pip install "ckptfx[cli]"') == 1


def test_demo_with_rich(monkeypatch: pytest.MonkeyPatch,
                        capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("rich")  # in the test extra
    monkeypatch.delenv("CKPTFX_PLAIN", raising=False)
    cli.main(["residuals", "--policy", "nothing_saveable"])
    cli.main(["demo"])
    captured = capsys.readouterr()
    assert "ckptfx[cli]" not in captured.err
    assert "remat(dots_saveable)" in captured.out and "┃ variant" in captured.out


BLOCK = textwrap.dedent("""
    import torch
    import torch.nn as nn
    import ckptfx

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            return self.fc2(ckptfx.checkpoint_name(torch.relu(self.fc1(x)), "h"))

    def two_inputs(x, y):
        return torch.tanh(x @ y)

    class NeedsArgs(nn.Module):
        def __init__(self, d):
            super().__init__()
""")


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "cli_user_block.py"
    path.write_text(BLOCK)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield path
    sys.modules.pop("cli_user_block", None)


def test_residuals_of_a_user_block(user_module: Path, plain: None,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    cli.main(["residuals", "cli_user_block:Block", "--shape", "2,4,8"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "remat(policy=dots_saveable) of cli_user_block:Block on (f32[2,4,8]) keeps:"
    assert "f32[16,8] from the parameter fc1.weight" in out
    assert any("output of aten.addmm" in line for line in out)
    assert out[-1].startswith("total: 4 residuals")

    cli.main(["residuals", f"{user_module}:Block", "--shape", "2,4,8",
              "--policy", "save_only_these_names:h"])
    out = capsys.readouterr().out
    assert "named 'h' at cli_user_block.py:" in out and "aten.addmm" not in out

    cli.main(["residuals", "cli_user_block:two_inputs", "--shape", "3,4", "--shape", "4,5",
              "--policy", "nothing_saveable"])
    out = capsys.readouterr().out.splitlines()
    assert sorted(out[1:3]) == ["f32[3,4] from the argument x", "f32[4,5] from the argument y"]
    assert out[3:] == ["total: 2 residuals, 128 B (0 B beyond the arguments)"]


def test_parse_policy_factories_with_arguments() -> None:
    cp = ckptfx.checkpoint_policies
    assert cli.parse_policy("dots_saveable") is cp.dots_saveable
    assert cli.parse_policy("save_only_these_names:attn,mlp") == cp.save_only_these_names(
        "attn", "mlp")
    assert cli.parse_policy("offload_dot_with_no_batch_dims:device,cpu") == (
        cp.offload_dot_with_no_batch_dims("device", "cpu"))
    assert cli.parse_policy("save_and_offload_only_these_names:names_which_can_be_saved=a+b,"
                            "names_which_can_be_offloaded=") == (
        cp.save_and_offload_only_these_names(names_which_can_be_saved=["a", "b"],
                                             names_which_can_be_offloaded=[]))
    assert cli.parse_policy("save_from_both_policies:dots_saveable,everything_saveable") == (
        cp.save_from_both_policies(cp.dots_saveable, cp.everything_saveable))


@pytest.mark.parametrize("factory", ["save_only_these_names", "memory_budget",
                                     "save_and_offload_only_these_names"])
def test_a_factory_without_arguments_shows_an_example_that_parses(factory: str) -> None:
    # The usage error's example is written for the factory (memory_budget takes a
    # fraction, not names), and the example itself is accepted.
    with pytest.raises(cli.UsageError, match=f"{factory} is a factory that needs arguments"
                       ) as info:
        cli.parse_policy(factory)
    example = str(info.value).rsplit("--policy ", 1)[1]
    assert example.startswith(f"{factory}:")
    assert callable(cli.parse_policy(example))


@pytest.mark.parametrize("argv, message", [
    (["residuals", "--policy", "no_such_policy"],
     "--policy: unknown policy 'no_such_policy'; expected one of"),
    (["residuals", "--policy", "save_only_these_names"],
     "--policy: save_only_these_names is a factory that needs arguments"),
    (["residuals", "--policy", "dots_saveable:x"], "--policy: dots_saveable takes no arguments"),
    (["residuals", "--policy", "offload_dot_with_no_batch_dims:host"],
     "refused the arguments 'host': src (offload_src in the policy factories) must be "
     "'device'"),
    (["residuals", "--policy", "save_from_both_policies:dots_saveable,save_only_these_names"],
     "--policy: save_from_both_policies takes two policies without arguments, by name"),
    (["residuals", "no_colon", "--shape", "2"], "TARGET expects MODULE:FUNCTION"),
    (["residuals", "no_such_module_xyz:f", "--shape", "2"],
     "TARGET: cannot import module 'no_such_module_xyz'"),
    (["residuals", "cli_user_block:Nope", "--shape", "2"],
     "TARGET: module 'cli_user_block' has no 'Nope'; callables there: Block, NeedsArgs"),
    (["residuals", "cli_user_block:NeedsArgs", "--shape", "2"],
     "TARGET: NeedsArgs() cannot be built without arguments"),
    (["residuals", "cli_user_block:Block"], "--shape is required with a MODULE:FUNCTION"),
    (["residuals", "cli_user_block:Block", "--shape", "2,x"],
     "--shape expects comma-separated positive integers such as 2,16,32"),
    (["residuals", "cli_user_block:Block", "--shape", "2,0"],
     "--shape expects comma-separated positive integers"),
    (["residuals", "cli_user_block:Block", "--shape", "2,4,7"],
     "calling Block(f32[2,4,7]) raised RuntimeError: mat1 and mat2 shapes cannot be "
     "multiplied"),
    (["residuals", "--shape", "2,4"], "--shape goes with a MODULE:FUNCTION target"),
    (["bench", "--variants", "none,bogus"], "--variants: unknown 'bogus'; expected"),
    (["bench", "--device", "nodevice"], "--device expects a torch device"),
    pytest.param(["bench", "--device", "cuda"], "--device cuda: no cuda device here",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present")),
    (["bench", "--threads", "0"], "--threads expects a positive integer"),
    (["bench", "--quick", "--full"], "not allowed with argument"),
    (["bench", "--overhead", "--out", "x"], "--out belongs to the decoder benchmark"),
    (["bench", "--tiny", "--out", __file__], "exists and is not a directory"),
    (["bench", "--tiny", "--out", __file__ + "/results"], "is not a directory"),
    (["bench", "--overhead", "--rounds", "0"], "--rounds expects a positive integer"),
    (["bench", "--overhead", "--only", "bogus"], "invalid choice: 'bogus'"),
    (["bench", "--only", "remat"], "--only and --rounds belong to --overhead"),
    (["nocommand"], "invalid choice: 'nocommand'"),
])
def test_usage_errors_exit_2(argv: list[str], message: str, user_module: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ckptfx") and message in err, err
    assert "Traceback" not in err


def test_bench_variant_registry() -> None:
    cpu = bench_variants.available("cpu")
    assert [v.name for v in cpu][:4] == ["none", "torch", "torch_sac_dots", "ckptfx"]
    assert all(not v.accelerator_only for v in cpu)
    assert "remat:offload_dot_with_no_batch_dims" in [v.name for v in
                                                     bench_variants.available("cuda")]
    budgets = [v for v in bench_variants.VARIANTS.values() if v.family == "budget"]
    # memory_budget variants exist exactly when the policy does
    assert bool(budgets) == hasattr(ckptfx.checkpoint_policies, "memory_budget")
    with pytest.raises(ValueError, match="already registered"):
        bench_variants.register(bench_variants.VARIANTS["none"])
    with pytest.raises(ValueError, match="unknown bench variant 'x'; registered: none, torch"):
        bench_variants.get("x")


def test_bench_tiny_writes_results_and_plots(tmp_path: Path, plain: None,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)  # the bench must not need the source checkout's directory
    cli.main(["bench", "--tiny", "--variants", "none,remat:dots_saveable", "--out", str(out)])
    captured = capsys.readouterr()
    res = json.loads((out / "results.json").read_text())
    assert res["ckptfx"] == ckptfx.__version__ and res["torch"] == torch.__version__
    assert res["mode"] == "tiny" and res["config"]["dim"] == 32 and res["date"]
    assert res["clock"] == "thread_cpu"  # one CPU thread: the step's CPU time
    rows = {r["name"]: r for r in res["variants"]}
    assert list(rows) == ["none", "remat:dots_saveable"]
    for r in rows.values():
        assert r["bitwise_equal"] is True
        assert r["step_s"] > 0 and r["tokens_per_s"] == pytest.approx(
            res["tokens_per_step"] / r["step_s"])
        assert isinstance(r["peak_bytes"], (int, float)) and r["peak_bytes"] >= 0
        assert len(r["peak_samples"]) == 1 and len(r["step_s_samples"]) == 1
        assert r["wall_s"] > 0 and len(r["wall_s_samples"]) == 1
        assert set(r) >= {"label", "family", "held_bytes", "memory_saved",
                          "tokens_per_s_change"}
    assert rows["none"]["tokens_per_s_change"] == 0
    split = res["split"]
    assert split["k"] == [1, 2] and split["torch_checkpoint"] == [2, 3]
    assert split["ckptfx_session"] == [1, 1] and split["bitwise_equal"] is True
    assert "| remat dots_saveable |" in (out / "table.md").read_text()
    assert "remat dots_saveable" in captured.out and "[6/6] split k=2" in captured.err
    if importlib.util.find_spec("matplotlib") is not None:
        for png in ("memory_vs_time.png", "split_replays.png"):
            assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Without matplotlib: results.json and table.md, and how to get the plots.
    monkeypatch.setattr("ckptfx.bench.have_matplotlib", lambda: False)
    again = tmp_path / "again"
    written = write_outputs(res, str(again))
    assert sorted(os.listdir(again)) == ["results.json", "table.md"] and len(written) == 2
    assert 'the PNG plots need matplotlib: pip install "ckptfx[plot]"' in capsys.readouterr().out


def test_bench_overhead_runs_from_the_package(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """``ckptfx bench --overhead`` (the per-call overhead figures) runs from an installed
    ckptfx, in any directory; one round of remat's part is a smoke run."""
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    cli.main(["bench", "--overhead", "--quick", "--only", "remat", "--rounds", "1"])
    out = capsys.readouterr().out
    assert "nothing_saveable / torch checkpoint:" in out and "dots_saveable / torch SAC:" in out
    assert "verdict on the per-call overhead targets" in out
    assert "remat nothing_saveable forward / torch checkpoint, d=64" in out
    assert torch.get_num_threads() == threads  # the one-thread setting is put back


def test_bench_vjp256_runs_again_in_a_process_keeping_freed_memory(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The d=256 part runs a second time in a new process whose glibc keeps freed memory
    (malloc reads its settings at start-up); its figures come back renamed. Tiny sizes: a
    smoke run of the mechanism, not a measurement."""
    import platform
    import subprocess

    from ckptfx.bench import overhead_split

    if platform.libc_ver()[0] != "glibc":
        assert overhead_split.bench_vjp256_keeping_freed_memory(1) == {}
        assert "needs glibc: skipped" in capsys.readouterr().out
        return
    envs: list[dict[str, str]] = []
    real_run = subprocess.run

    def spy(*args: object, **kwargs: object) -> object:
        envs.append(kwargs["env"])  # type: ignore[arg-type]
        return real_run(*args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(overhead_split.subprocess, "run", spy)
    figures = overhead_split.bench_vjp256_keeping_freed_memory(1, d=16, seq=4, nblocks=2)
    out = capsys.readouterr().out
    assert len(envs) == 1  # one child, started with the settings
    assert all(envs[0][k] == v for k, v in overhead_split.KEEP_FREED_MEMORY.items())
    assert {"vjp256_kept_vs_fused", "vjp256_kept_torch_plain_split_vs_fused",
            "vjp256_kept_late_drop_vs_fused", "vjp256_kept_page_faults_vjp_split"} <= set(figures)
    assert all(k.startswith("vjp256_kept_") for k in figures)
    assert "  dx + dw, 2 checkpointed transformer blocks d=16" in out  # the child's report
    assert "  minor page faults per step: fused" in out


def test_bench_vjp256_keeping_freed_memory_reports_a_failed_child(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A child that fails gives no figures (the verdict then has no line for them) and shows
    its exit status and stderr; the rest of the run goes on."""
    import subprocess

    from ckptfx.bench import overhead_split

    monkeypatch.setattr(overhead_split.platform, "libc_ver", lambda: ("glibc", "2.36"))
    for k in overhead_split.KEEP_FREED_MEMORY:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(overhead_split.subprocess, "run", lambda args, **kw:
                        subprocess.CompletedProcess(args, 1, "", "Traceback: boom\n"))
    assert overhead_split.bench_vjp256_keeping_freed_memory(1) == {}
    out = capsys.readouterr().out
    assert "Traceback: boom" in out and "failed: exit 1, no figures" in out


def test_bench_vjp256_keeping_freed_memory_needs_no_child_when_this_process_keeps_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from ckptfx.bench import overhead_split

    for k, v in overhead_split.KEEP_FREED_MEMORY.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(overhead_split.platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(overhead_split.subprocess, "run", None)  # no child may start
    assert overhead_split.bench_vjp256_keeping_freed_memory(1) == {}
    assert "already keeps freed memory" in capsys.readouterr().out


def test_bench_overhead_verdict_names_each_target_and_its_floor() -> None:
    from ckptfx.bench.figures import verdict

    lines = verdict({"split_sessions_vs_none": 1.29, "split_hook_floor_vs_none": 1.15,
                     "vjp256_vs_fused": 1.10, "vjp256_torch_plain_split_vs_fused": 1.12,
                     "vjp256_kept_vs_fused": 1.02, "vjp256_kept_torch_plain_split_vs_fused": 1.03,
                     "remat64_dots_vs_sac": 1.0})
    assert [line.split()[0] for line in lines] == ["met", "met", "NOT", "met"]
    assert lines[1].startswith("met      1.290x <= 1.3") and "(floor 1.150x)" in lines[1]
    assert "d=256 (floor 1.120x: the target is below it)" in lines[2]
    assert "keeping freed memory" in lines[3] and lines[3].endswith("(floor 1.030x)")
    assert verdict({}) == []  # a part not run: no line


def test_bench_ratio_figure_is_the_median_of_paired_rounds() -> None:
    from ckptfx.bench.figures import fmt, ratio

    # The machine slows to half speed during the run: four of five rounds time a at 1.2x b,
    # one caught the change between a and b. The medians fall in different speeds.
    times = {"a": [1.2, 1.2, 2.4, 2.4, 2.4], "b": [1.0, 1.0, 1.0, 2.0, 2.0]}
    figure, q1, q3, medians = ratio(times, "a", "b")
    assert (round(figure, 9), round(q1, 9), round(q3, 9)) == (1.2, 1.2, 1.2)
    assert round(medians, 9) == 2.4  # the ratio of medians: the drift, not the code
    assert fmt((figure, q1, q3, medians)) == (
        "1.200x (per-round IQR 1.200-1.200; medians' ratio 2.400)")


def test_bench_plot_labels_of_close_variants_do_not_overlap() -> None:
    """ckptfx's and torch's checkpoint land on nearly the same point of the memory-time
    plot: their labels are placed apart, not printed on top of each other."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ckptfx.bench import plot

    def row(label: str, family: str, ms: float, mib: float) -> dict[str, Any]:
        return {"label": label, "family": family, "step_s": ms / 1e3,
                "peak_bytes": mib * plot.MIB}

    results = {"variants": [row("none", "none", 10.0, 100.0),
                            row("torch checkpoint", "torch", 14.0, 42.0),
                            row("ckptfx.checkpoint", "ckptfx", 14.05, 42.1),
                            row("remat(nothing_saveable)", "remat", 14.1, 42.0),
                            row("remat(dots_saveable)", "remat", 12.0, 60.0)],
               "config": {"layers": 2, "dim": 64, "batch": 2, "seq": 16, "device": "cpu"},
               "date": "today"}
    fig, ax, labels = plot.memory_figure(plt, results)
    try:
        renderer = fig.canvas.get_renderer()
        boxes = [t.get_window_extent(renderer) for t in labels]
        assert len(boxes) == 5
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                assert not a.overlaps(b)
    finally:
        plt.close(fig)
