"""apply_activation_checkpointing and checkpoint(policy=...): blocks found, gradients bitwise.

Own models first (no extra packages), then Hugging Face transformers models with random
weights and tiny configs (skipped with a reason when transformers is not installed), then
a timm ViT (skipped when timm cannot be imported).
"""

from __future__ import annotations

import functools
import io
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from conftest import OpCounter, assert_bitwise, maybe_autocast
from models import Block
from torch import nn

import ckptfx
from ckptfx import checkpoint_policies as cp
from ckptfx.integrations import find_blocks

pytestmark = pytest.mark.usefixtures("no_hooks_left_behind")


class Net(nn.Module):
    def __init__(self, n: int = 3, p: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.heads = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])  # shorter list
        self.blocks = nn.ModuleList([Block(p=p, dropout_on_output=True) for _ in range(n)])
        self.mixed = nn.ModuleList([nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.GELU()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.heads[0](h)


def _grads(model: nn.Module, x: torch.Tensor, autocast: bool = False
           ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    torch.manual_seed(7)
    with maybe_autocast(autocast):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    return loss.detach(), [x.grad, *(p.grad for p in model.parameters())]


def _sac_mm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> torch_checkpoint.CheckpointPolicy:
    """A torch selective-checkpoint policy function (module level: picklable)."""
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return torch_checkpoint.CheckpointPolicy.MUST_SAVE
    return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


# -- finding blocks ------------------------------------------------------------------------


def test_find_blocks_takes_the_largest_module_list_of_one_type() -> None:
    net = Net()
    assert find_blocks(net) == list(net.blocks)  # not `heads` (shorter), not `mixed` (types)


class _Encoder(Block):
    pass


class _EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.ModuleList([_Encoder() for _ in range(3)])
        self.dec = nn.ModuleList([Block() for _ in range(2)])
        self.heads = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])  # leaves: no warning

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in (*self.enc, *self.dec):
            x = m(x)
        return self.heads[0](x)


def test_a_second_stack_of_blocks_left_plain_is_named_in_a_warning() -> None:
    # The largest-list rule finds one stack; an encoder-decoder's other stack stays plain,
    # and the warning says which, and the check_fn that takes both.
    model = _EncoderDecoder()
    with pytest.warns(UserWarning, match=r"checkpoints the 3 _Encoder modules .* leaves these "
                      r"repeated blocks plain: dec \(2 x Block\).*check_fn=lambda m: "
                      r"isinstance\(m, \(_Encoder, Block\)\)") as record:
        ckptfx.apply_activation_checkpointing(model)
    assert record[0].filename == __file__
    assert all(type(b) is not _Encoder for b in model.enc)
    assert all(type(b) is Block for b in model.dec)
    both = _EncoderDecoder()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckptfx.apply_activation_checkpointing(both, check_fn=lambda m: isinstance(m, Block))
        ckptfx.apply_activation_checkpointing(Net())  # its other lists are leaves or mixed
    assert all(type(b) is not _Encoder and type(b) is not Block for b in (*both.enc, *both.dec))


def test_find_blocks_without_repeated_blocks_says_to_pass_check_fn() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match="check_fn=lambda m: isinstance"):
        ckptfx.apply_activation_checkpointing(model)
    assert type(model[0]) is nn.Linear  # nothing changed


class _Stage(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def test_stages_of_blocks_warn_about_the_blocks_and_advise_wrapping_them_all() -> None:
    # Swin-like: stages of different depths, each a list of one block class. The largest
    # list's blocks are wrapped; the warning names the other stages' lists (not the list of
    # stages around them), and its check_fn wraps every block, not the stages.
    model = nn.Sequential()
    model.stages = nn.ModuleList([_Stage(2), _Stage(4), _Stage(2)])
    with pytest.warns(UserWarning, match=r"checkpoints the 4 Block modules .* plain: "
                      r"stages.0.blocks \(2 x Block\), stages.2.blocks \(2 x Block\)\. .*"
                      r"check_fn=lambda m: isinstance\(m, Block\)$"):
        ckptfx.apply_activation_checkpointing(model)
    advised = nn.Sequential()
    advised.stages = nn.ModuleList([_Stage(2), _Stage(4), _Stage(2)])
    ckptfx.apply_activation_checkpointing(advised, check_fn=lambda m: isinstance(m, Block))
    assert all(type(s) is _Stage for s in advised.stages)
    assert all(type(b) is not Block for s in advised.stages for b in s.blocks)


def test_a_sequential_of_torch_containers_is_not_offered_as_the_blocks() -> None:
    body = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.GELU()) for _ in range(3)])
    with pytest.raises(ValueError, match=r"of one type\. Say which modules to checkpoint: "
                       r"check_fn=lambda m: isinstance\(m, MyBlock\)"):
        ckptfx.apply_activation_checkpointing(nn.Sequential(body, nn.Linear(4, 4)))


def test_blocks_in_a_sequential_outside_timm_are_named_in_the_error() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(Block(), Block(), Block())

    model = Model()
    with pytest.raises(ValueError, match=r"its nn.Sequential 'blocks' holds 3 Block modules.*"
                       r"check_fn=lambda m: isinstance\(m, Block\)"):
        ckptfx.apply_activation_checkpointing(model)
    assert all(type(b) is Block for b in model.blocks)  # nothing changed
    ckptfx.apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    assert all(type(b) is not Block and isinstance(b, Block) for b in model.blocks)


def test_check_fn_wraps_the_outermost_matches_and_never_the_model() -> None:
    net = Net()
    ckptfx.apply_activation_checkpointing(net, check_fn=lambda m: isinstance(m, (Net, Block,
                                                                                  nn.Linear)))
    assert type(net) is Net
    assert all(type(b) is not Block and isinstance(b, Block) for b in net.blocks)
    assert all(type(lin) is nn.Linear for b in net.blocks for lin in (b.fc1, b.fc2))
    assert type(net.embed) is not nn.Linear  # a Linear outside the blocks matches too


@pytest.mark.parametrize("check_fn", [Block, (Block, nn.LayerNorm)], ids=["class", "tuple"])
def test_check_fn_as_a_class_wraps_its_instances_without_building_one(check_fn: Any) -> None:
    built = []
    init = Block.__init__

    def counting_init(self: Block, *a: Any, **k: Any) -> None:
        built.append(1)
        init(self, *a, **k)

    net = Net()
    Block.__init__ = counting_init  # type: ignore[method-assign]
    try:
        ckptfx.apply_activation_checkpointing(net, check_fn=check_fn)
    finally:
        Block.__init__ = init  # type: ignore[method-assign]
    assert not built
    assert all(type(b) is not Block and isinstance(b, Block) for b in net.blocks)
    by_lambda = Net()
    ckptfx.apply_activation_checkpointing(by_lambda, check_fn=lambda m: isinstance(m, check_fn))
    assert [type(m).__name__ for m in net.modules()] == [
        type(m).__name__ for m in by_lambda.modules()]


@pytest.mark.parametrize("kwargs, exc, words", [
    ({"check_fn": 3}, TypeError, "check_fn must be a callable"),
    ({"check_fn": (Block, 3)}, TypeError, "check_fn must be a callable"),
    ({"check_fn": lambda m: False}, ValueError, "check_fn matched no submodule"),
    ({"policy": cp.save_only_these_names}, TypeError, "policy factory"),
    ({"policy": "dots"}, TypeError, "policy must be a checkpoint policy"),
    ({"early_stop": 1}, TypeError, "early_stop must be a bool"),
])
def test_bad_input_leaves_the_model_unchanged(kwargs: dict[str, Any], exc: type,
                                              words: str) -> None:
    net = Net()
    with pytest.raises(exc, match=words):
        ckptfx.apply_activation_checkpointing(net, **kwargs)
    assert all(type(b) is Block for b in net.blocks)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        ckptfx.apply_activation_checkpointing(lambda x: x)  # type: ignore[type-var]


# -- own models: parity, replays, state ----------------------------------------------------


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("policy", [None, cp.dots_saveable, cp.nothing_saveable, _sac_mm],
                         ids=["checkpoint", "dots_saveable", "nothing_saveable", "torch_sac"])
def test_own_model_gradients_bitwise(policy: Any, autocast: bool) -> None:
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(4, 8)
    loss, expected = _grads(net, x, autocast)
    assert [b.runs for b in net.blocks] == [1, 1, 1]
    keys = list(net.state_dict())
    assert ckptfx.apply_activation_checkpointing(net, policy=policy) is net
    got_loss, got = _grads(net, x, autocast)
    assert torch.equal(got_loss, loss)
    assert_bitwise(got, expected)
    assert list(net.state_dict()) == keys
    assert all(isinstance(b, Block) for b in net.blocks)
    # A plain checkpoint re-runs each block's forward once in the backward; a policy
    # replays the recorded ops instead (the Python forward runs once).
    assert [b.runs for b in net.blocks] == [3, 3, 3] if policy is None else [2, 2, 2]


def test_policy_decides_what_the_backward_recomputes() -> None:
    """Count the matmuls of one backward: dots_saveable (and torch's MUST_SAVE for mm) keep
    every matmul output, as no checkpoint does; nothing_saveable recomputes them."""
    x = torch.randn(4, 8)

    def backward_mms(policy: Any, wrap: bool) -> int:
        torch.manual_seed(0)
        net = Net()
        if wrap:
            ckptfx.apply_activation_checkpointing(net, policy=policy)
        loss = net(x.requires_grad_()).sum()
        with OpCounter() as ops:
            loss.backward()
        return ops.counts.get("mm", 0) + ops.counts.get("addmm", 0)

    plain = backward_mms(None, wrap=False)
    assert backward_mms(cp.dots_saveable, wrap=True) == plain
    assert backward_mms(_sac_mm, wrap=True) == plain
    assert backward_mms(cp.nothing_saveable, wrap=True) == plain + 6  # 3 blocks x 2 Linears
    assert backward_mms(None, wrap=True) == plain + 6


@pytest.mark.parametrize("policy", [None, cp.dots_saveable, _sac_mm],
                         ids=["checkpoint", "dots_saveable", "torch_sac"])
def test_torch_save_and_load_keep_the_checkpointing(policy: Any) -> None:
    torch.manual_seed(0)
    net = ckptfx.apply_activation_checkpointing(Net(), policy=policy)
    buf = io.BytesIO()
    torch.save(net, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded.blocks[0]) is type(net.blocks[0])
    assert loaded.state_dict().keys() == net.state_dict().keys()
    x = torch.randn(4, 8)
    _, expected = _grads(net, x)
    calls = [b.runs for b in loaded.blocks]
    _, got = _grads(loaded, x)
    assert_bitwise(got, expected)
    assert [b.runs - c for b, c in zip(loaded.blocks, calls)] == [2 if policy is None else 1] * 3


def test_differential_against_torch_apply_activation_checkpointing() -> None:
    """torch's apply_activation_checkpointing (non-reentrant wrapper) and ckptfx's on the
    same model: the same gradients and block runs as no checkpoint's (plus one replay per
    block); torch's renames every parameter of a block (its state_dict hooks strip the
    prefix again), ckptfx's renames nothing."""
    from torch.distributed.algorithms._checkpoint import (
        checkpoint_wrapper as torch_wrap,
    )

    x = torch.randn(4, 8)
    torch.manual_seed(0)
    plain = Net()
    _, expected = _grads(plain, x)
    runs: dict[str, list[int]] = {}
    for variant in ("torch", "ckptfx"):
        torch.manual_seed(0)
        net = Net()
        keys = list(net.state_dict())
        names = [n for n, _ in net.named_parameters()]
        if variant == "torch":
            torch_wrap.apply_activation_checkpointing(
                net, checkpoint_wrapper_fn=functools.partial(
                    torch_wrap.checkpoint_wrapper,
                    checkpoint_impl=torch_wrap.CheckpointImpl.NO_REENTRANT),
                check_fn=lambda m: isinstance(m, Block))
            blocks = [b._checkpoint_wrapped_module for b in net.blocks]
            assert any("_checkpoint_wrapped_module" in n for n, _ in net.named_parameters())
        else:
            ckptfx.apply_activation_checkpointing(net)
            blocks = list(net.blocks)
            assert [n for n, _ in net.named_parameters()] == names
        assert list(net.state_dict()) == keys
        _, got = _grads(net, x)
        assert_bitwise(got, expected)
        runs[variant] = [b.runs for b in blocks]
    assert runs["torch"] == runs["ckptfx"] == [2, 2, 2]


def test_applying_again_updates_the_policy() -> None:
    net = ckptfx.apply_activation_checkpointing(Net(), policy=cp.dots_saveable)
    ckptfx.apply_activation_checkpointing(net)
    assert net.blocks[0]._ckptfx_options == {"early_stop": True}
    ckptfx.unwrap_checkpoint(net.blocks[0])
    assert type(net.blocks[0]) is Block


# -- checkpoint(policy=...) ----------------------------------------------------------------


def _mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.dropout(torch.tanh(x @ w1), 0.2) @ w2


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_checkpoint_policy_against_torch_selective_checkpoint(autocast: bool) -> None:
    """The same policy function under no checkpoint, torch's selective checkpoint and
    ckptfx.checkpoint(policy=...): the same gradients, the same backward matmuls."""
    torch.manual_seed(0)
    args = [torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True),
            torch.randn(8, 8, requires_grad=True)]

    def run(variant: str) -> tuple[list[torch.Tensor], dict[str, int]]:
        torch.manual_seed(3)
        with maybe_autocast(autocast):
            if variant == "plain":
                out = _mlp(*args)
            elif variant == "torch":
                out = torch_checkpoint.checkpoint(
                    _mlp, *args, use_reentrant=False,
                    context_fn=functools.partial(
                        torch_checkpoint.create_selective_checkpoint_contexts, _sac_mm))
            else:
                out = ckptfx.checkpoint(_mlp, *args, policy=_sac_mm)
        with OpCounter() as ops:
            g = torch.autograd.grad(out.float().sum(), args)
        return list(g), ops.counts

    plain, plain_ops = run("plain")
    for variant in ("torch", "ckptfx"):
        got, ops = run(variant)
        assert_bitwise(got, plain)
        assert ops.get("mm", 0) == plain_ops.get("mm", 0)


@pytest.mark.parametrize("options, exc, words", [
    ({"context_fn": torch_checkpoint.noop_context_fn, "policy": cp.dots_saveable}, None, None),
    ({"context_fn": lambda: (None, None), "policy": cp.dots_saveable}, ValueError,
     "pass one of them"),
    ({"debug": True, "policy": cp.dots_saveable}, ValueError, "Drop debug=True"),
    ({"policy": cp.save_only_these_names}, TypeError, "policy factory"),
    ({"policy": 3}, TypeError, "policy must be a checkpoint policy"),
])
def test_checkpoint_policy_bad_input(options: dict[str, Any], exc: type | None,
                                     words: str | None) -> None:
    x = torch.randn(2, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    if exc is None:
        ckptfx.checkpoint(_mlp, x, w, w, **options).sum().backward()
        return
    with pytest.raises(exc, match=words):
        ckptfx.checkpoint(_mlp, x, w, w, **options)


def test_checkpoint_wrapper_name_policy_warns_once_per_module() -> None:
    torch.manual_seed(0)
    block = ckptfx.checkpoint_wrapper(Block(), policy=cp.save_only_these_names("attn_out"))
    x = torch.randn(2, 8)
    with pytest.warns(ckptfx.UnusedNameWarning, match="attn_out"):
        block(x).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        block(x).sum().backward()


def test_a_wrapped_module_keeps_its_forward_signature_for_reports_and_tools() -> None:
    # inspect.signature(module.forward) is what tools (and residual reports) read; a
    # wrapped module's forward shows the plain one's, and the report names the argument as
    # remat(module) does.
    import inspect

    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    wrapped = ckptfx.checkpoint_wrapper(nn.Sequential(nn.Linear(4, 4), nn.ReLU()),
                                        policy=cp.dots_saveable)
    assert inspect.signature(wrapped.forward) == inspect.signature(plain.forward)
    x = torch.randn(2, 4, requires_grad=True)
    def arguments(fun: Any) -> list[str]:
        return [r.source for r in ckptfx.saved_residuals(fun, x)
                if r.source.startswith("from the argument")]

    assert arguments(wrapped) == arguments(ckptfx.remat(plain, policy=cp.dots_saveable))
    assert arguments(wrapped) == ["from the argument input"]


def test_bare_checkpoint_name_policy_warns_once_per_block_at_the_users_line() -> None:
    # checkpoint(fn, policy=...) may get a new function or partial on every call (Hugging
    # Face passes a new partial of the layer's __call__); the check is the block's, so one
    # misspelt name warns once for the block, pointing at the call in this file.
    import functools

    torch.manual_seed(0)
    block = Block()
    x = torch.randn(2, 8, requires_grad=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            ckptfx.checkpoint(functools.partial(block.__call__), x,
                              policy=cp.save_only_these_names("atn_out")).sum().backward()
    unused = [w for w in record if w.category is ckptfx.UnusedNameWarning]
    assert len(unused) == 1
    assert "of block Block (" in str(unused[0].message) and "['atn_out']" in str(unused[0].message)
    assert unused[0].filename == __file__


def test_name_checks_of_bare_calls_are_per_method_and_see_through_decorators() -> None:
    # Two methods of one module, or two functions behind one decorator, are two blocks: a
    # name the second one misses is reported for it, under its own name.
    import functools

    def decorated(f: Any) -> Any:
        @functools.wraps(f)
        def wrapper(*args: Any) -> Any:
            return f(*args)
        return wrapper

    @decorated
    def attn(x: torch.Tensor) -> torch.Tensor:
        return ckptfx.checkpoint_name(x.sin(), "attn_out")

    @decorated
    def mlp(x: torch.Tensor) -> torch.Tensor:
        return ckptfx.checkpoint_name(x.cos(), "mlp_out")

    class Layer(nn.Module):
        def _attn(self, x: torch.Tensor) -> torch.Tensor:
            return attn(x)

        def _mlp(self, x: torch.Tensor) -> torch.Tensor:
            return mlp(x)

    policy = cp.save_only_these_names("attn_out")
    x = torch.randn(3, requires_grad=True)
    for calls, blocks in (([attn, mlp], "mlp"), ([Layer()._attn, Layer()._mlp], "Layer._mlp")):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            for fn in calls:
                ckptfx.checkpoint(fn, x, policy=policy).sum().backward()
        unused = [str(w.message) for w in record if w.category is ckptfx.UnusedNameWarning]
        assert len(unused) == 1 and f".{blocks} (" in unused[0], unused


def test_hugging_face_layers_warn_about_a_name_their_forward_never_tags() -> None:
    model = _hf_model("llama")
    ckptfx.apply_activation_checkpointing(model, policy=cp.save_only_these_names("attn"))
    ids = torch.randint(0, 64, (2, 8))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    unused = [w for w in record if w.category is ckptfx.UnusedNameWarning]
    assert len(unused) == 1  # once for the layer class, not per layer or per step
    assert "of block LlamaDecoderLayer" in str(unused[0].message)
    assert unused[0].filename == __file__


def test_checkpoint_policy_under_torch_compile_matches_eager() -> None:
    """Under torch.compile the policy is handed to torch's checkpoint as a selective
    checkpoint context (aot_eager: the partitioner, without the C++ compiler), made by the
    eager call before (dynamo takes a context_fn only as a constant)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    x, w1, w2 = (torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True),
                 torch.randn(8, 8, requires_grad=True))

    def block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w1) @ w2

    ckptfx.checkpoint(block, x, w1, w2, policy=cp.dots_saveable)
    compiled = torch.compile(lambda *a: ckptfx.checkpoint(block, *a, policy=cp.dots_saveable),
                             backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(x, w1, w2).sum(), [x, w1, w2])
    expected = torch.autograd.grad(block(x, w1, w2).sum(), [x, w1, w2])
    assert_bitwise(list(got), list(expected))


# -- Hugging Face transformers -------------------------------------------------------------


def _hf_model(family: str) -> nn.Module:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                  attention_dropout=0.1)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                         n_positions=32)  # dropouts: 0.1 by default
        cls = transformers.GPT2LMHeadModel
    else:
        config_cls, cls = {
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
            "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        }[family]
        config = config_cls(**common)
    torch.manual_seed(0)
    model = cls(config)
    model.train()
    return model


def _hf_step(model: nn.Module, ids: torch.Tensor, autocast: bool
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(11)
    with maybe_autocast(autocast):
        # use_cache=False, as checkpointing forces: a KV cache built in the unchecked run
        # changes GPT-2's attention numerics with dropout on (measured, with torch's
        # checkpoint as with ckptfx's).
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def _assert_same_step(got: tuple[torch.Tensor, dict[str, torch.Tensor]],
                      expected: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> None:
    assert torch.equal(got[0], expected[0]), (got[0], expected[0])
    assert got[1].keys() == expected[1].keys() and len(got[1]) > 0
    for name in expected[1]:
        assert torch.equal(got[1][name], expected[1][name]), name


def _count_mlp_calls(model: nn.Module) -> list[int]:
    """Forward runs of each layer's MLP (inside the checkpointed layer forward; a pre-hook,
    since an early-stopped replay ends inside the MLP)."""
    counts: list[int] = []
    for layer in find_blocks(model):
        mlp = layer.mlp
        counts.append(0)
        i = len(counts) - 1
        mlp.register_forward_pre_hook(lambda *a, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("policy", [None, cp.dots_saveable], ids=["checkpoint", "dots"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gpt2"])
def test_hf_model_gradients_bitwise(family: str, policy: Any, autocast: bool) -> None:
    model = _hf_model(family)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    expected = _hf_step(model, ids, autocast)
    keys = list(model.state_dict())
    layers = find_blocks(model)
    assert len(layers) == 2 and all(type(b).__name__.endswith(("DecoderLayer", "Block"))
                                    for b in layers)
    ckptfx.apply_activation_checkpointing(model, policy=policy)
    assert model.is_gradient_checkpointing
    counts = _count_mlp_calls(model)
    _assert_same_step(_hf_step(model, ids, autocast), expected)
    assert counts == ([2, 2] if policy is None else [1, 1])  # forward (+ one replay)
    assert list(model.state_dict()) == keys
    assert all(type(b) is type(layers[0]) for b in find_blocks(model))


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_hf_gpt2_differential_against_torch_checkpoint() -> None:
    """Through Hugging Face's own switch: no checkpoint, torch's checkpoint, ckptfx's (with
    and without a policy) give the same loss and gradients, bit for bit."""
    model = _hf_model("gpt2")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    expected = _hf_step(model, ids, autocast=False)
    for func in (functools.partial(torch_checkpoint.checkpoint, use_reentrant=False),
                 ckptfx.checkpoint, functools.partial(ckptfx.checkpoint, policy=cp.dots_saveable)):
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=func)
        _assert_same_step(_hf_step(model, ids, autocast=False), expected)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_hf_gradient_checkpointing_func_with_a_policy() -> None:
    """Hugging Face's own switch, with ckptfx's checkpoint and a policy."""
    model = _hf_model("llama")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    expected = _hf_step(model, ids, autocast=False)
    model._set_gradient_checkpointing(
        enable=True,
        gradient_checkpointing_func=functools.partial(ckptfx.checkpoint,
                                                      policy=cp.dots_saveable))
    with OpCounter() as ops:
        got = _hf_step(model, ids, autocast=False)
    _assert_same_step(got, expected)
    model.gradient_checkpointing_disable()
    with OpCounter() as plain_ops:
        _hf_step(model, ids, autocast=False)
    assert ops.counts["mm"] == plain_ops.counts["mm"]  # every matmul kept, none recomputed


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_hf_model_torch_save_and_load() -> None:
    model = ckptfx.apply_activation_checkpointing(_hf_model("gpt2"), policy=cp.dots_saveable)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    expected = _hf_step(model, ids, autocast=False)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.is_gradient_checkpointing
    _assert_same_step(_hf_step(loaded, ids, autocast=False), expected)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_hf_eval_mode_does_not_checkpoint() -> None:
    model = ckptfx.apply_activation_checkpointing(_hf_model("llama"))
    model.eval()
    counts = _count_mlp_calls(model)
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert counts == [1, 1]


# -- timm ----------------------------------------------------------------------------------


def _import_timm() -> Any:
    try:
        import timm
    except Exception as err:  # a torchvision that does not match torch fails at import too
        pytest.skip(f"timm cannot be imported here: {type(err).__name__}: {err}")
    return timm


@pytest.mark.parametrize("policy", [None, cp.dots_saveable], ids=["checkpoint", "dots"])
def test_timm_vit_gradients_bitwise(policy: Any) -> None:
    timm = _import_timm()
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32,
                              patch_size=8, embed_dim=32, depth=2, num_heads=2,
                              num_classes=4, drop_rate=0.1, proj_drop_rate=0.1,
                              attn_drop_rate=0.1)
    model.train()
    assert find_blocks(model) == list(model.blocks)
    x = torch.randn(2, 3, 32, 32)
    loss, expected = _grads(model, x)
    ckptfx.apply_activation_checkpointing(model, policy=policy)
    got_loss, got = _grads(model, x)
    assert torch.equal(got_loss, loss)
    assert_bitwise(got, expected)


# -- a model-level memory budget -------------------------------------------------------------


def _backward_flops(model: nn.Module, x: torch.Tensor) -> int:
    """FLOPs of one backward (replays included), counted by torch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    loss = model(x.detach().requires_grad_()).pow(2).mean()
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("budget", [0.0, 0.3, 1.0])
def test_memory_budget_spreads_over_the_blocks_bitwise(budget: float) -> None:
    torch.manual_seed(0)
    net, x = Net(), torch.randn(4, 8)
    expected = [_grads(net, x) for _ in range(2)]
    keys = list(net.state_dict())
    ckptfx.apply_activation_checkpointing(net, memory_budget=budget)
    policies = [b.__dict__["_ckptfx_options"]["policy"] for b in net.blocks]
    assert len({id(p) for p in policies}) == len(net.blocks)  # one share per block
    got = [_grads(net, x) for _ in range(2)]  # the first step plans, the second uses the plan
    for g, e in zip(got, expected):
        assert_bitwise([g[0], *g[1]], [e[0], *e[1]])
    assert list(net.state_dict()) == keys
    buf = io.BytesIO()
    torch.save(net, buf)
    buf.seek(0)
    assert type(torch.load(buf, weights_only=False).blocks[0]) is type(net.blocks[0])


def test_memory_budget_recomputes_less_with_more_budget() -> None:
    x = torch.randn(4, 8)
    flops = []
    for budget in (0.0, 0.5, 1.0):
        torch.manual_seed(0)
        net = ckptfx.apply_activation_checkpointing(Net(p=0.0), memory_budget=budget)
        _grads(net, x)  # plans
        flops.append(_backward_flops(net, x))
    torch.manual_seed(0)
    plain = _backward_flops(Net(p=0.0), x)
    assert flops[0] > flops[1] >= flops[2] == plain, (flops, plain)


def test_memory_budget_bad_input_leaves_the_model_unchanged() -> None:
    net = Net()
    for kwargs, exc, words in [
        ({"memory_budget": 1.5}, ValueError, r"\[0, 1\]"),
        ({"memory_budget": "0.5"}, TypeError, "float"),
        ({"memory_budget": 0.5, "policy": cp.dots_saveable}, ValueError, "not both"),
    ]:
        with pytest.raises(exc, match=words):
            ckptfx.apply_activation_checkpointing(net, **kwargs)
        assert all(type(b) is Block for b in net.blocks)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_hf_memory_budget_gives_each_layer_its_share() -> None:
    model = _hf_model("llama")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    expected = _hf_step(model, ids, False)
    nothing = ckptfx.apply_activation_checkpointing(_hf_model("llama"), memory_budget=0.0)
    ckptfx.apply_activation_checkpointing(model, memory_budget=0.5)
    layers = find_blocks(model)
    policies = [layer._gradient_checkpointing_func.keywords["policy"] for layer in layers]
    assert len({id(p) for p in policies}) == len(layers)  # one share per layer
    for _ in range(2):  # planning step, then the planned one
        _assert_same_step(_hf_step(model, ids, False), expected)
    from torch.utils.flop_counter import FlopCounterMode

    flops = []
    for m in (nothing, model):
        loss = m(input_ids=ids, labels=ids, use_cache=False).loss
        with FlopCounterMode(display=False) as counter:
            loss.backward()
        flops.append(counter.get_total_flops())
    assert flops[1] < flops[0], flops  # the planned layers keep values: less recompute


# -- Hugging Face Trainer (integrations.py Rule 5) -----------------------------------------------


def _trainer_run(tmp_path: Path, apply: dict[str, Any] | None, **args: Any
                 ) -> tuple[dict[str, torch.Tensor], nn.Module]:
    """Two Trainer steps of a random-init Llama (dropout on); the weights after them."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("accelerate", reason="Trainer needs accelerate")
    model = _hf_model("llama")
    if apply is not None:
        ckptfx.apply_activation_checkpointing(model, **apply)
    ids = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    training = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
        learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no",
        logging_strategy="no", dataloader_num_workers=0, seed=3, disable_tqdm=True, **args)
    transformers.Trainer(model=model, args=training, train_dataset=data).train()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, model


def _checkpointed_by(model: nn.Module) -> list[Any]:
    return [getattr(m, "_gradient_checkpointing_func", None) if m.gradient_checkpointing
            else None for m in find_blocks(model)]


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("kwargs", [None, {"policy": cp.dots_saveable}],
                         ids=["policy_applied", "policy_in_kwargs"])
def test_trainer_activation_checkpointing_keeps_ckptfx(tmp_path: Path,
                                                       kwargs: dict[str, Any] | None) -> None:
    """Trainer's activation_checkpointing=True after ckptfx was applied keeps ckptfx (it
    used to put torch's checkpoint in its place, silently), with the policy given in
    activation_checkpointing_kwargs or else the one applied; weights bitwise those of the
    same Trainer without checkpointing."""
    expected, _ = _trainer_run(tmp_path / "plain", None)
    applied = {"policy": cp.checkpoint_dots_with_no_batch_dims}
    got, model = _trainer_run(tmp_path / "ckptfx", applied, activation_checkpointing=True,
                              activation_checkpointing_kwargs=kwargs)
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    want = kwargs["policy"] if kwargs else applied["policy"]
    for func in _checkpointed_by(model):
        assert func.func is ckptfx.checkpoint and func.keywords["policy"] is want


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_hf_enable_every_n_layers_and_refusals_with_ckptfx_applied() -> None:
    model = ckptfx.apply_activation_checkpointing(_hf_model("llama"))
    buf = io.BytesIO()
    torch.save(model, buf)  # the keeper pickles with the model (Hugging Face's enable makes
    buf.seek(0)             # an unpicklable hook of its own, so this comes first)
    loaded = torch.load(buf, weights_only=False)
    loaded.activation_checkpointing_enable(activation_checkpointing_kwargs={
        "policy": cp.dots_saveable})
    assert all(f.keywords["policy"] is cp.dots_saveable for f in _checkpointed_by(loaded))
    model.activation_checkpointing_enable(every_n_layers=2)
    funcs = _checkpointed_by(model)
    assert funcs[0].func is ckptfx.checkpoint and funcs[1] is None  # layer 0 of 2
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert all(f is not None and f.func is ckptfx.checkpoint for f in _checkpointed_by(model))
    for kwargs, exc, match in [
        ({"activation_checkpointing_kwargs": {"use_reentrant": True}}, ValueError,
         "no reentrant"),
        ({"activation_checkpointing_kwargs": {"preserve_rng_state": False}}, TypeError,
         r"\['preserve_rng_state'\] are not options"),
        ({"offload": True}, ValueError, "offload_dot_with_no_batch_dims"),
        ({"every_n_layers": 0}, ValueError, "every_n_layers must be a positive int"),
    ]:
        with pytest.raises(exc, match=match):
            model.activation_checkpointing_enable(**kwargs)
        assert all(f is not None and f.func is ckptfx.checkpoint  # unchanged
                   for f in _checkpointed_by(model))


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_remat_hf_layer_under_compile_with_its_kv_cache_names_the_cache_and_the_fix() -> None:
    """A remat'd decoder layer given its KV cache (use_cache on, the model's default) under
    torch.compile: torch's checkpoint op replays the cache's append and fails in the
    backward; the error names the cache and use_cache=False (lowering.py Rule 8)."""
    model = _hf_model("llama")
    for layer in find_blocks(model):
        layer.forward = ckptfx.remat(layer.forward, policy=cp.dots_saveable)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    try:
        loss = torch.compile(model, backend="aot_eager")(input_ids=ids, labels=ids).loss
        with pytest.raises(ckptfx.CheckpointError, match="use_cache=False"):
            loss.backward()
    finally:
        torch._dynamo.reset()


def test_blocks_kept_in_a_module_dict_are_found_as_torchtitan_keeps_them() -> None:
    from ckptfx.bench.blocks import MLPBlock

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleDict({str(i): MLPBlock(8, 16) for i in range(3)})
            self.head = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers.values():
                x = layer(x)
            return self.head(x)

    torch.manual_seed(0)
    model = Model()
    assert ckptfx.integrations.find_blocks(model) == list(model.layers.values())
    x = torch.randn(4, 8, requires_grad=True)
    expected = torch.autograd.grad(model(x).sum(), [x, *model.parameters()])
    ckptfx.apply_activation_checkpointing(model)
    got = torch.autograd.grad(model(x).sum(), [x, *model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert all("_ckptfx_options" in layer.__dict__ for layer in model.layers.values())
