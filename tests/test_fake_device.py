"""The fake accelerator behaves as CUDA does wherever ckptfx's device tests rely on it.

If one of these fails, a device test's verdict means nothing: fix ``tests/fake_device`` first.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

import fake_device
from conftest import settle_device_threads

pytestmark = pytest.mark.skipif(not fake_device.available(),
                                reason=fake_device.UNAVAILABLE or "fake device not registered")
DEV = torch.device(fake_device.NAME, 0)


def test_torch_sees_an_accelerator_with_two_devices() -> None:
    assert torch.accelerator.current_accelerator() == torch.device(fake_device.NAME)
    assert torch.accelerator.device_count() == 2
    x = torch.randn(3, device=f"{fake_device.NAME}:1")
    assert x.device.index == 1 and (x + x).device.index == 1
    with torch.fakeacc.device(1):
        assert torch.empty(2, device=fake_device.NAME).device.index == 1
    assert torch.fakeacc.current_device() == 0


def test_the_backward_of_each_device_runs_on_its_own_autograd_thread() -> None:
    threads = {}
    for index in (0, 1):
        x = torch.randn(4, device=torch.device(fake_device.NAME, index), requires_grad=True)
        y = x.sin()
        y.register_hook(lambda g, index=index: threads.update({index: threading.get_ident()}))
        y.sum().backward()
    assert threading.get_ident() not in threads.values()
    assert threads[0] != threads[1]


def test_ops_give_the_cpu_results_views_and_in_place_writes_included() -> None:
    a = torch.randn(5, 6)
    d = a.to(DEV)
    assert torch.equal((d @ d.t()).cpu(), a @ a.t())
    view = d[1:, ::2]
    view.mul_(2)  # writes through the view into d
    a[1:, ::2].mul_(2)
    assert torch.equal(d.cpu(), a)
    assert view.data_ptr() != d.data_ptr() and view.untyped_storage().data_ptr() == d.untyped_storage().data_ptr()
    out = torch.empty(0, device=DEV)
    torch.sin(d, out=out)  # an out= argument is resized as on CUDA
    assert torch.equal(out.cpu(), a.sin())


def test_mixing_devices_fails_before_any_kernel_as_on_cuda() -> None:
    d = torch.randn(3, 3, device=DEV)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        d @ torch.randn(3, 3)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        d + torch.randn(3, 3, device=f"{fake_device.NAME}:1")
    assert torch.equal((d * torch.tensor(2.0)).cpu(), d.cpu() * 2)  # a CPU scalar is allowed


def test_each_device_has_its_own_seedable_generator_that_random_ops_use() -> None:
    torch.manual_seed(0)  # seeds the device generators too
    cpu_state = torch.get_rng_state()
    state = torch.fakeacc.get_rng_state(0)
    first = [F.dropout(torch.ones(64, device=DEV), 0.5), torch.rand(8, device=DEV),
             torch.randn(8, device=DEV), torch.ones(8, device=DEV).bernoulli_(0.3)]
    assert torch.equal(torch.get_rng_state(), cpu_state)  # the CPU generator is untouched
    other = torch.fakeacc.get_rng_state(1)
    torch.fakeacc.set_rng_state(state, 0)
    again = [F.dropout(torch.ones(64, device=DEV), 0.5), torch.rand(8, device=DEV),
             torch.randn(8, device=DEV), torch.ones(8, device=DEV).bernoulli_(0.3)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert torch.equal(torch.fakeacc.get_rng_state(1), other)  # device 1 drew nothing
    assert not torch.equal(first[0], torch.ones(64, device=DEV) * 2)  # it did drop


def test_an_explicit_device_generator_is_honoured() -> None:
    g = torch.Generator(device=DEV).manual_seed(3)
    assert g.device == DEV
    state = g.get_state()
    a = torch.rand(6, device=DEV, generator=g)
    g.set_state(state)
    assert torch.equal(a, torch.rand(6, device=DEV, generator=g.manual_seed(3)))
    default = torch.fakeacc.get_rng_state(0)
    torch.randn(6, device=DEV, generator=g)
    assert torch.equal(torch.fakeacc.get_rng_state(0), default)


def test_device_autocast_casts_as_cuda_autocast_does() -> None:
    x = torch.randn(4, 4, device=DEV)
    with torch.autocast(fake_device.NAME, dtype=torch.bfloat16):
        assert (x @ x).dtype == torch.bfloat16  # lower-precision list
        assert (x @ x).softmax(-1).dtype == torch.float32  # fp32 list
        assert F.gelu(x).dtype == torch.float32  # not listed: untouched
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (x @ x).dtype == torch.float32  # CPU autocast leaves the device alone


def test_pinned_host_memory_and_streams_and_events() -> None:
    pinned = torch.ones(16).pin_memory()
    assert pinned.is_pinned() and not torch.ones(16).is_pinned()
    assert torch.empty(8, pin_memory=True).is_pinned()
    side = torch.Stream(fake_device.NAME)
    assert side != torch.accelerator.current_stream()
    with side:
        assert torch.accelerator.current_stream() == side
        copy = pinned.to(DEV, non_blocking=True)
        done = torch.Event(fake_device.NAME)
        done.record()
    torch.accelerator.current_stream().wait_event(done)
    assert done.query()
    assert torch.equal(copy.cpu(), pinned)


def test_memory_is_counted_per_device() -> None:
    settle_device_threads()  # an earlier backward's graph is freed now, not while counting
    before = torch.fakeacc.memory_allocated(1)
    torch.fakeacc.reset_peak_memory_stats(1)
    x = torch.empty(1024, device=f"{fake_device.NAME}:1")
    assert torch.fakeacc.memory_allocated(1) == before + 4096
    del x
    assert torch.fakeacc.memory_allocated(1) == before
    assert torch.fakeacc.max_memory_allocated(1) == before + 4096


def test_torch_accelerator_memory_api_reads_the_fake_devices_counts() -> None:
    """Libraries call torch.accelerator's memory API on whatever device there is
    (accelerate empties the cache between steps): the fake device's allocator answers it."""
    settle_device_threads()  # an earlier backward's graph is freed now, not while counting
    torch.accelerator.empty_cache()
    before = torch.accelerator.memory_allocated()
    x = torch.empty(1000, device=DEV)
    assert torch.accelerator.memory_allocated() == before + 4000
    assert torch.accelerator.max_memory_allocated() >= before + 4000
    del x
    torch.accelerator.reset_peak_memory_stats()
    assert torch.accelerator.max_memory_allocated() == torch.accelerator.memory_allocated()
    assert torch.accelerator.memory_allocated() == before
