"""torch.compile and offloading: ``ckptfx.offload_in_compile`` (lowering.py, Rule 4).

Backend aot_eager, with the partitioned graphs kept (``Capture``): a value is offloaded when
the forward graph moves it (``prims.device_put`` or torch's ``ao.offload``) and the backward
brings it back; which value it is is read from the graph (a ``checkpoint_name``'d value by
its name, another by its op). Gradients are compared bitwise with eager ckptfx and with the
block without checkpointing (fp32), and under CPU bf16 autocast with the same backend
compiling the block without checkpointing (aot_eager traces autocast: its bf16 roundings are
not eager's). The accelerator cases run on the fake one (tests/fake_device), where a value
really goes to host memory and back.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable, Iterator

import pytest
import torch
import torch._functorch.config as functorch_config
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

import ckptfx
from ckptfx import checkpoint_policies as cp
from ckptfx import lowering
from ckptfx.offload import compiled as compile_offload

from conftest import ACCELERATOR, assert_bitwise, maybe_autocast, needs_accelerator

pytestmark = pytest.mark.usefixtures("no_sessions_left", "no_hooks_left_behind")

aten = torch.ops.aten
D, N = 16, 32  # width, batch: each block value is 2 KiB in fp32, 1 KiB in bf16 (>= min_bytes)
KEYS = ("enable_activation_offloading", "activation_offload_separate_stream",
        "activation_offload_sink_wait", "activation_reload_prefetch",
        "activation_offload_cpu_gpu_bw", "joint_custom_pass")


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    lowering._offload_warned[0] = False
    compile_offload._kept_warned.clear()
    yield
    torch._dynamo.reset()


class Capture:
    """aot_eager that keeps the partitioned graphs and the devices of what each forward
    saved for the backward (its outputs after the first ``n_outputs``)."""

    def __init__(self, n_outputs: int = 1) -> None:
        self.forward: list[torch.fx.GraphModule] = []
        self.backward: list[torch.fx.GraphModule] = []
        self.saved_devices: list[str] = []
        self.n_outputs = n_outputs

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        def fw(g: torch.fx.GraphModule, ex: Any) -> Any:
            self.forward.append(g)

            def run(*args: Any) -> Any:
                outs = g(*args)
                self.saved_devices += [o.device.type for o in outs[self.n_outputs:]
                                       if isinstance(o, torch.Tensor)]
                return outs
            return make_boxed_func(run)

        def bw(g: torch.fx.GraphModule, ex: Any) -> Any:
            self.backward.append(g)
            return make_boxed_func(g.forward)

        return aot_autograd(fw_compiler=fw, bw_compiler=bw)(gm, example_inputs)

    def moved(self, op: Any) -> list[str]:
        """What the forward graphs move with ``op``: names of named values, else op names."""
        out = []
        for g in self.forward:
            for n in g.graph.find_nodes(op="call_function", target=op):
                src = n.args[0]
                out.append(src.args[1] if src.target is lowering.NAME_OP else str(src.target))
        return sorted(out)

    def count(self, op: Any) -> int:
        return sum(len(g.graph.find_nodes(op="call_function", target=op))
                   for g in [*self.forward, *self.backward])


DEVICE_PUT = torch.ops.prims.device_put.default


def ao_ops() -> tuple[Any, Any]:
    from torch._functorch._activation_offloading import offload_ops  # registers torch.ops.ao

    del offload_ops
    return torch.ops.ao.offload.default, torch.ops.ao.reload.default


# -- the block: two named values the backward reads ("a" by gelu, "b" by sin), dropout --------


def make_body(dropout: float) -> Callable[..., torch.Tensor]:
    def body(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        a = ckptfx.checkpoint_name(F.linear(x, p["w1"]), "a")
        h = F.dropout(F.gelu(a), dropout)
        b = ckptfx.checkpoint_name(F.linear(h, p["w2"]), "b")
        return torch.sin(b)
    return body


body = make_body(0.25)
# torch compiles a checkpointed region's random ops for CPU, CUDA, XPU and HPU only
# (torch/_prims/rng_prims.py): on the fake accelerator the block has no dropout.
device_body = make_body(0.25 if ACCELERATOR is not None
                        and ACCELERATOR.type in ("cuda", "xpu", "hpu") else 0.0)


POLICY = cp.save_and_offload_only_these_names(names_which_can_be_saved=["a"],
                                              names_which_can_be_offloaded=["b"])


def two_blocks(block: Callable[..., Any]) -> Callable[..., Any]:
    def model(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return block({k: v[:] for k, v in p.items()}, block(p, x))
    return model


def make_inputs(device: Any = "cpu") -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    p = {k: torch.randn(D, D, generator=g).to(device).requires_grad_() for k in ("w1", "w2")}
    return p, torch.randn(N, D, generator=g).to(device).requires_grad_()


def step(fn: Callable[..., Any], p: dict[str, torch.Tensor], x: torch.Tensor,
         autocast: bool = False) -> list[torch.Tensor]:
    torch.manual_seed(7)
    if x.device.type != "cpu":
        torch.get_device_module(x.device.type).manual_seed(7)
    with maybe_autocast(autocast):
        out = fn(p, x)
    return [out.detach(), *torch.autograd.grad(out.float().sum(), [x, p["w1"], p["w2"]])]


# -- what is offloaded --------------------------------------------------------------------------


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_opt_in_offloads_what_the_policy_offloads_and_nothing_else(autocast: bool) -> None:
    # The device_put mode marks host values too (its move to the CPU is the tensor itself),
    # so the CPU graph shows exactly what the policy offloads: "b" of each block, not "a".
    p, x = make_inputs()
    capture = Capture()
    model = torch.compile(two_blocks(ckptfx.remat(body, policy=POLICY)), backend=capture)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ckptfx.CompileOffloadWarning)
        with lowering.offload_in_compile(separate_stream=False):
            got = step(model, p, x, autocast)
    assert capture.moved(DEVICE_PUT) == ["b", "b"]
    assert capture.count(DEVICE_PUT) == 4  # and each brought back in the backward
    if autocast:  # the same backend without checkpointing, and without the opt-in
        for reference in (two_blocks(body), two_blocks(ckptfx.remat(body, policy=POLICY))):
            torch._dynamo.reset()
            assert_bitwise(got, step(torch.compile(reference, backend="aot_eager"),
                                     p, x, autocast))
    else:
        assert_bitwise(got, step(two_blocks(ckptfx.remat(body, policy=POLICY)), p, x))
        assert_bitwise(got, step(two_blocks(body), p, x))


def test_values_under_min_bytes_are_kept_on_the_device() -> None:
    # as eager remat: a copy of a small value costs more than it frees (Offload.min_bytes)
    p, x = make_inputs()
    capture = Capture()
    policy = ckptfx.policies.SaveAndOffloadOnlyTheseNames(
        ["a"], ["b"], ckptfx.Offload(min_bytes=N * D * 4 + 1))
    with lowering.offload_in_compile(separate_stream=False):
        got = step(torch.compile(ckptfx.remat(body, policy=policy), backend=capture), p, x)
    assert capture.moved(DEVICE_PUT) == []
    assert_bitwise(got, step(body, p, x))


def test_host_values_stay_in_place_with_a_side_stream() -> None:
    # torch's side-stream ops need an accelerator stream: CPU values are not marked (the
    # default mode), so nothing is moved, the graph runs and the gradients are exact.
    p, x = make_inputs()
    capture = Capture()
    with lowering.offload_in_compile():
        got = step(torch.compile(ckptfx.remat(body, policy=POLICY), backend=capture), p, x)
    offload, reload = ao_ops()
    assert capture.count(offload) == capture.count(reload) == capture.count(DEVICE_PUT) == 0
    assert_bitwise(got, step(body, p, x))


def torch_sac(policy: Callable[..., Any]) -> Callable[..., Any]:
    """``body`` under torch's own selective checkpoint with ``policy``."""
    context = functools.partial(create_selective_checkpoint_contexts, policy)  # a constant

    def fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return checkpoint(body, p, x, use_reentrant=False, context_fn=context)
    return fn


def offload_mm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return (CheckpointPolicy.MUST_CPU_OFFLOAD if op is aten.mm.default
            else CheckpointPolicy.PREFER_RECOMPUTE)


def test_torch_sac_cpu_offload_is_lowered_only_inside_the_opt_in() -> None:
    # torch tags the nodes MUST_CPU_OFFLOAD and nothing else reads the tag: the partitioner
    # keeps or recomputes them as it likes (here it keeps both on the CPU, no move). Inside
    # the opt-in the pass marks them: both matmuls' outputs move (the named copies, which a
    # torch policy recomputes, are made again from them in the backward).
    p, x = make_inputs()
    expected = step(body, p, x)
    for opt_in in (False, True):
        torch._dynamo.reset()
        capture = Capture()
        with lowering.offload_in_compile(separate_stream=False) if opt_in else (
                contextlib.nullcontext()):
            got = step(torch.compile(torch_sac(offload_mm), backend=capture), p, x)
        assert capture.moved(DEVICE_PUT) == (["aten.mm.default"] * 2 if opt_in else [])
        assert_bitwise(got, expected)


def offload_transpose(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return (CheckpointPolicy.MUST_CPU_OFFLOAD if op is aten.t.default
            else CheckpointPolicy.PREFER_RECOMPUTE)


def test_values_the_partitioner_cannot_move_stay_with_a_warning() -> None:
    p, x = make_inputs()
    capture = Capture()
    with lowering.offload_in_compile(separate_stream=False):
        with pytest.warns(ckptfx.CompileOffloadWarning, match=r"aten\.t\.default, a view"):
            got = step(torch.compile(torch_sac(offload_transpose), backend=capture), p, x)
    assert capture.moved(DEVICE_PUT) == []
    assert_bitwise(got, step(body, p, x))


# -- on an accelerator: values go to host memory and back ----------------------------------------


@needs_accelerator
@pytest.mark.parametrize("separate_stream", [True, False], ids=["stream", "device_put"])
def test_accelerator_values_go_to_the_host_and_back(separate_stream: bool) -> None:
    assert ACCELERATOR is not None
    p, x = make_inputs(ACCELERATOR)
    capture = Capture()
    model = torch.compile(two_blocks(ckptfx.remat(device_body, policy=POLICY)), backend=capture)
    with lowering.offload_in_compile(separate_stream=separate_stream):
        got = step(model, p, x)
    offload, reload = ao_ops()
    move, back = (offload, reload) if separate_stream else (DEVICE_PUT, DEVICE_PUT)
    assert capture.moved(move) == ["b", "b"]
    assert capture.count(back) == (2 if separate_stream else 4)
    # what the forward saved: the offloaded values on the host, the rest on the device
    assert sorted(capture.saved_devices).count("cpu") == 2
    assert set(capture.saved_devices) == {"cpu", ACCELERATOR.type}
    assert_bitwise(got, step(two_blocks(ckptfx.remat(device_body, policy=POLICY)), p, x))
    assert_bitwise(got, step(two_blocks(device_body), p, x))


@needs_accelerator
def test_without_the_opt_in_offloads_stay_on_the_device_with_a_warning() -> None:
    assert ACCELERATOR is not None
    p, x = make_inputs(ACCELERATOR)
    capture = Capture()
    with pytest.warns(ckptfx.CompileOffloadWarning, match=r"offload_in_compile\(\)"):
        got = step(torch.compile(ckptfx.remat(device_body, policy=POLICY), backend=capture), p, x)
    offload, _ = ao_ops()
    assert capture.moved(offload) == capture.moved(DEVICE_PUT) == []
    assert capture.saved_devices and set(capture.saved_devices) == {ACCELERATOR.type}
    assert_bitwise(got, step(device_body, p, x))


# -- the opt-in itself ----------------------------------------------------------------------------


def config_now() -> dict[str, Any]:
    return {k: getattr(functorch_config, k) for k in KEYS}


def user_pass(gm: torch.fx.GraphModule, joint_inputs: Any) -> torch.fx.GraphModule:
    USER_PASS_RUNS[0] += 1
    return gm


USER_PASS_RUNS = [0]


def test_config_is_patched_inside_and_restored_after_exit_and_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # prefetch's CUDA check
    with functorch_config.patch(joint_custom_pass=user_pass, activation_offload_cpu_gpu_bw=9.0):
        before = config_now()
        opt_in = lowering.offload_in_compile(prefetch=True, bandwidth_gbps=20)
        with opt_in:
            inside = config_now()
            assert compile_offload.offloading_in_compile()
            with lowering.offload_in_compile(separate_stream=False):  # nested: one pass
                assert functorch_config.joint_custom_pass.then is user_pass
                assert functorch_config.activation_offload_separate_stream is False
            assert config_now() == inside
        assert config_now() == before
        assert not compile_offload.offloading_in_compile()
        with pytest.raises(KeyError, match="inside"):
            with opt_in:
                raise KeyError("inside")
        assert config_now() == before
    assert inside["joint_custom_pass"].then is user_pass
    assert {k: inside[k] for k in KEYS[:5]} == {
        "enable_activation_offloading": True, "activation_offload_separate_stream": True,
        "activation_offload_sink_wait": False, "activation_reload_prefetch": True,
        "activation_offload_cpu_gpu_bw": 20.0}


def test_the_users_joint_pass_still_runs() -> None:
    p, x = make_inputs()
    capture = Capture()
    USER_PASS_RUNS[0] = 0
    with functorch_config.patch(joint_custom_pass=user_pass):
        with lowering.offload_in_compile(separate_stream=False):
            step(torch.compile(ckptfx.remat(body, policy=POLICY), backend=capture), p, x)
    assert USER_PASS_RUNS[0] == 1
    assert capture.moved(DEVICE_PUT) == ["b"]


def test_the_policy_offloads_only_while_aot_autograd_traces_inside_the_opt_in() -> None:
    x = torch.randn(2, 2)
    ask = lowering.CompiledPolicy(cp.offload_dot_with_no_batch_dims())
    with lowering.offload_in_compile():
        # not tracing (dynamo's eager backend runs torch's eager checkpoint): kept
        assert ask(None, aten.mm.default, x, x) is CheckpointPolicy.MUST_SAVE
    assert ask(None, aten.mm.default, x, x) is CheckpointPolicy.MUST_SAVE


@pytest.mark.parametrize("kwargs, error, match", [
    ({"separate_stream": 1}, TypeError, "separate_stream must be a bool, got int"),
    ({"prefetch": "yes"}, TypeError, "prefetch must be a bool, got str"),
    ({"separate_stream": False, "prefetch": True}, ValueError, "need separate_stream=True"),
    ({"separate_stream": False, "sink_wait": True}, ValueError, "need separate_stream=True"),
    ({"prefetch": True, "bandwidth_gbps": "50"}, TypeError, "bandwidth_gbps must be a number"),
    ({"prefetch": True, "bandwidth_gbps": 0}, ValueError, "positive finite"),
    ({"prefetch": True, "bandwidth_gbps": float("inf")}, ValueError, "positive finite"),
    ({"bandwidth_gbps": 10.0}, ValueError, "read by prefetch only"),
    pytest.param({"prefetch": True}, ValueError, "prefetch=True needs CUDA",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")),
])
def test_bad_arguments_raise_and_change_nothing(kwargs: dict[str, Any], error: type,
                                                match: str) -> None:
    before = config_now()
    with pytest.raises(error, match=match):
        lowering.offload_in_compile(**kwargs)
    assert config_now() == before


class CountDevicePuts(torch._inductor.custom_graph_pass.CustomGraphPass):
    """Inductor's post-grad pre-pass (before its no-op removal drops a device_put to the
    device a value is on): the device_puts of each graph it compiles."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.counts.append(len(graph.find_nodes(op="call_function", target=DEVICE_PUT)))

    def uuid(self) -> None:
        return None  # not cacheable: inductor compiles afresh


@pytest.mark.slow
def test_inductor_lowers_the_opt_in_too() -> None:
    # forward and backward of the two blocks: one move out and one back per block; the
    # reference is inductor without the opt-in (inductor fuses differently from eager)
    p, x = make_inputs()
    counting = CountDevicePuts()
    model = two_blocks(ckptfx.remat(body, policy=POLICY))
    with torch._inductor.config.patch(post_grad_custom_pre_pass=counting):
        with lowering.offload_in_compile(separate_stream=False):
            got = step(torch.compile(model, backend="inductor"), p, x)
    assert counting.counts == [2, 2]
    torch._dynamo.reset()
    assert_bitwise(got, step(torch.compile(model, backend="inductor"), p, x))
