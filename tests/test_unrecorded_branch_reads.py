"""A tensor only a later, unrecorded call of a remat'd block reads (a branch its first call
did not take; ckptfx.recording.unrecorded Rule 4d): changed between that call's forward and
its backward, the re-run in the backward would read the new tensor and hand out wrong
gradients (torch's checkpoint does). The later call notes what it could read, and its
re-run raises ``CheckpointError`` naming the place instead; unchanged, it replays bitwise,
and a layer reading all its tensors notes nothing (the forward's hot path)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.utils.checkpoint as tcp
from torch import nn

import ckptfx
from ckptfx.recording import places, unrecorded
from conftest import assert_bitwise

pytestmark = pytest.mark.usefixtures("no_hooks_left_behind")


def _modes() -> int:
    return torch._C._len_torch_dispatch_stack()


class Branchy(nn.Module):
    """Reads buffer ``a`` until ``use_b`` is set, then ``b``: Python state the signature does
    not hold, so the later calls that read ``b`` run unrecorded on what the first learnt."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("a", torch.full((4,), 2.0))
        self.register_buffer("b", torch.full((4,), 3.0))
        self.register_buffer("never", torch.ones(4))
        self.use_b = False
        self.write_b = False
        self.modes: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.modes.append(_modes())
        s = self.b if self.use_b else self.a
        if self.write_b:
            self.b.add_(1.0)  # a write only the later calls make (after reading b)
        return (x * s).sin()


def _later_call(block: Callable[..., Any], m: Branchy) -> tuple[torch.Tensor, torch.Tensor]:
    """The first call (reads ``a``), then a call reading ``b``: (its output, its input)."""
    x0 = torch.randn(4, requires_grad=True)
    block(x0).sum().backward()
    m.use_b = True
    x = torch.randn(4, requires_grad=True)
    return block(x), x


def test_a_buffer_only_a_later_call_reads_replays_bitwise_when_unchanged() -> None:
    """Watching costs no exactness: the later call runs unrecorded and its re-run, which
    reads the watched buffer, matches the plain block bit for bit."""
    torch.manual_seed(0)
    m = Branchy()
    out, x = _later_call(ckptfx.remat(m), m)
    assert m.modes[-1] == 0  # unrecorded
    (got,) = torch.autograd.grad(out.sum(), [x])
    (ref,) = torch.autograd.grad(m(x).sum(), [x])
    assert_bitwise([got], [ref])


def test_a_buffer_only_a_later_call_reads_modified_in_place_raises() -> None:
    """Was silently wrong (as torch's checkpoint is, shown here); now the re-run refuses at
    its first read of the buffer, naming it and the fix."""
    torch.manual_seed(0)
    m = Branchy()
    out, x = _later_call(ckptfx.remat(m), m)
    assert m.modes[-1] == 0
    (ref,) = torch.autograd.grad(m(x).sum(), [x])
    m.b.mul_(2)
    with pytest.raises(ckptfx.CheckpointError,
                       match=r"(?s)buffer 'b' of Branchy.*modified in place.*always_record"):
        out.sum().backward()
    assert x.grad is None
    theirs = tcp.checkpoint(m, x, use_reentrant=False)
    m.b.mul_(2)
    (wrong,) = torch.autograd.grad(theirs.sum(), [x])
    assert not torch.equal(wrong, ref)


def test_a_later_calls_own_write_to_a_buffer_it_reads_raises() -> None:
    """The re-run would repeat the write and read the written buffer: refused, where a
    first call making the write would have kept the block recorded."""
    torch.manual_seed(0)
    m = Branchy()
    block = ckptfx.remat(m)
    block(torch.randn(4, requires_grad=True)).sum().backward()
    m.use_b = m.write_b = True
    out = block(torch.randn(4, requires_grad=True))
    assert m.modes[-1] == 0
    with pytest.raises(ckptfx.CheckpointError, match="buffer 'b' of Branchy"):
        out.sum().backward()


def test_a_buffer_replaced_before_the_backward_raises() -> None:
    """An assignment (not an in-place write) puts another tensor where the forward found
    ``b``: the re-run would read that one."""
    torch.manual_seed(0)
    m = Branchy()
    out, _ = _later_call(ckptfx.remat(m), m)
    m.b = torch.full((4,), 5.0)
    with pytest.raises(ckptfx.CheckpointError,
                       match=r"(?s)buffer 'b' of Branchy.*put there after"):
        out.sum().backward()


def test_a_watched_tensor_the_replay_does_not_read_may_change() -> None:
    """Only what the re-run reads is checked: a buffer of the block's module that no call
    reads may change between forward and backward."""
    torch.manual_seed(0)
    m = Branchy()
    out, x = _later_call(ckptfx.remat(m), m)
    (ref,) = torch.autograd.grad(m(x).sum(), [x])
    m.never.mul_(2)
    (got,) = torch.autograd.grad(out.sum(), [x])
    assert_bitwise([got], [ref])


_GLOBAL_SCALE = torch.full((4,), 3.0)
_GLOBAL_MODE = {"on": False}


def _global_block(x: torch.Tensor) -> torch.Tensor:
    return (x * _GLOBAL_SCALE).sin() if _GLOBAL_MODE["on"] else x.sin()


def _closure_block() -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, dict]:
    t = torch.full((4,), 3.0)
    mode = {"on": False}

    def block(x: torch.Tensor) -> torch.Tensor:
        return (x * t).sin() if mode["on"] else x.sin()
    return block, t, mode


@pytest.mark.parametrize("where", ["closure", "global"])
def test_a_closure_or_global_tensor_only_a_later_call_reads_is_checked(where: str) -> None:
    """The first call reads no tensor from outside (so later calls run unrecorded); a later
    one reads a closure's or a global's tensor: unchanged, bitwise; modified in place, a
    ``CheckpointError`` naming the variable."""
    if where == "closure":
        block, t, mode = _closure_block()
        label = "closure variable 't'"
    else:
        block, t, mode = _global_block, _GLOBAL_SCALE, _GLOBAL_MODE
        label = "global '_GLOBAL_SCALE'"
    mode["on"] = False
    rematted = ckptfx.remat(block)
    rematted(torch.randn(4, requires_grad=True)).sum().backward()
    mode["on"] = True
    try:
        x = torch.randn(4, requires_grad=True)
        (got,) = torch.autograd.grad(rematted(x).sum(), [x])
        (ref,) = torch.autograd.grad(block(x).sum(), [x])
        assert_bitwise([got], [ref])
        out = rematted(x)
        with torch.no_grad():
            t.mul_(2)
        with pytest.raises(ckptfx.CheckpointError, match=f"(?s){label}.*modified in place"):
            out.sum().backward()
    finally:
        mode["on"] = False
        with torch.no_grad():
            t.fill_(3.0)


def test_a_layer_reading_all_its_tensors_notes_nothing_more() -> None:
    """The hot path: a later call of a layer whose first call read every tensor it holds
    notes no watched place, and its replay runs no read check."""
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 6))
    rematted = ckptfx.remat(layer)
    x = torch.randn(3, 6, requires_grad=True)
    rematted(x).sum().backward()
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = rematted(x)
    rerun = handles[0].frame.rerun
    assert isinstance(rerun, unrecorded._Rerun)
    assert rerun.watched == [] and len(rerun.outside) == 4
    out.sum().backward()


def test_a_method_of_a_large_module_stays_unrecorded_and_notes_its_own_modules() -> None:
    """A method of a module holding many other tensors (a model, for one layer) notes those
    of the modules its first call read from and of the module itself, not every other
    layer's (bounded by ``_MAX_WATCHED``), and still runs unrecorded."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(20))
            self.register_buffer("scale", torch.ones(4))
            self.modes: list[int] = []

        def run_first(self, x: torch.Tensor) -> torch.Tensor:
            self.modes.append(_modes())
            return self.layers[0](x).tanh()

    torch.manual_seed(0)
    model = Model()
    rematted = ckptfx.remat(model.run_first)
    x = torch.randn(2, 4, requires_grad=True)
    rematted(x).sum().backward()
    with ckptfx.recompute_handle_collector_ctx() as handles:
        out = rematted(x)
    assert model.modes[-1] == 0
    watched = {name for _, name, _, _, _ in handles[0].frame.rerun.watched}
    assert watched == {"scale"}
    assert len(model.layers) * 2 - 2 > places._MAX_WATCHED
    out.sum().backward()


def test_a_module_argument_only_a_later_call_reads_from_is_checked() -> None:
    """A module passed as an argument (the signature holds it by identity) whose buffer only
    a later call reads: modified in place before the backward, refused."""
    torch.manual_seed(0)
    m = Branchy()
    mode = {"on": False}

    def block(x: torch.Tensor, mod: Branchy) -> torch.Tensor:
        return (x * mod.b).sin() if mode["on"] else x.sin()

    rematted = ckptfx.remat(block)
    rematted(torch.randn(4, requires_grad=True), m).sum().backward()
    mode["on"] = True
    x = torch.randn(4, requires_grad=True)
    (got,) = torch.autograd.grad(rematted(x, m).sum(), [x])
    (ref,) = torch.autograd.grad(block(x, m).sum(), [x])
    assert_bitwise([got], [ref])
    out = rematted(x, m)
    m.b.mul_(2)
    with pytest.raises(ckptfx.CheckpointError, match="buffer 'b' of Branchy"):
        out.sum().backward()
