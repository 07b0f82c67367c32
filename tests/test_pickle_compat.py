"""Saved models keep loading: pickles name the public modules, and the package's layout is
free to change under them.

``torch.save(model)`` of a model whose blocks went through ``checkpoint_wrapper(policy=...)``
stores each policy, the module's name check and the function that rebuilds the checkpointed
class; Hugging Face's ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)``
stores ``functools.partial(ckptfx.checkpoint, ...)``. Each is stored by module path and name.
"""

from __future__ import annotations

import base64
import functools
import pickle
import pickletools
import warnings
import zlib

import torch
from torch import nn

import ckptfx
from ckptfx import checkpoint_policies as cp

# Written by ckptfx 0.1.0 before the package was split into subpackages (protocol 2, zlib,
# base64): {"modules": ModuleList of checkpoint_wrapper(nn.Tanh(), policy=p) for every policy
# class, budget policies and a model-level budget's shares included, each run once;
# "hf_partial": functools.partial(ckptfx.checkpoint, policy=cp.dots_saveable)}.
PICKLED_BEFORE_THE_MOVE = (
    "eNp1mGdg3EQWgB2nopCEVEISQid2AJNeaEkcJwGSbIISiChGaLXajNZryW+kteOAIAE2OPRerzcOjuN6771wd1zv"
    "het3XO+9zHvz5NmNHf9YjUZvRvN9741W6wOtGbS0ORNbWlp641KtGiQwxk9j6YuOKOrgrg4/jlIvjAJpbaeebWGS"
    "WtDafhDGZjCuzZmkhqdSRYTRXhg/5ExW526fJ73eIA1kAhMymEhBbrFWLmPPpAyOceZjTxRHbp/qUlMGUZoHuEmQ"
    "guW76jyspmHkupbqsWByNxxbhyk2THVm0nye3zPgyZLbJwNXxHFPAtN8P65WAz8N4yixdshSIINSV+ir0ce12zDd"
    "mdY0UA+aIfDaTGcOXgsTt1yrVptjYFbBmYpXy7FsGDibBs5x5o245A6EqXBxgr0JHE9hc50FI8O86oA3mLi+pxZd"
    "ghMocJ4zozHQwM2nywuchaNebrrliRS60JmOoUnqpYFbUhZ4opPo6snO7COumludQhGnarJq7JVGDzuNwk7XyRwR"
    "Fif5Dc+guDN1GeS1tiiDtjZnjOpaAu2+39OXlvd1+CJQrTiMUsuNggHXnAclCxaPLE9P5brfw3xbu71IWHBWHc62"
    "4ZwMOtrE+CGhyu9coSpuibCEKqCldVhmw3IxjVa0QujcrxSzCkJnc5XQ6VotdDbWCK19rdBOzxPa3vlCO7pAaAkX"
    "Cg15kVBc63SdaSY37qNyhPUZbHAmqAt9cTX0B6Ezh6bzMEisTf2BHEyF2km7vP7AK1YDCzaqndaVOFMaJozU3kpg"
    "U6FWJH1LYbNYLBT3FhsuzuCSnPtS5N6qubfVYbsNBebewdw7DfdlzG0z9y7m3s3clzP3Fcy9h7kd5r4Sua8SivFq"
    "MRKsEB9BdY2i6k7EMMMyuFYzuDZcl4GXMxSRwdcMpToENpSZYS8zCMMQMkOFGXqYocoMvcwQMUPMDH3MAMggkSEZ"
    "haErThMDkCqAWgb9tIniqDrohmX1PFPPjdQXagP0JjBwOCk2IC6HfRpx0Ib9GVyfI96AiJlGvLEON9lwgBEPMuLN"
    "BvEWRryVEeuMeIgRb2PEIUY8zIi3M+IdiHgnIt4lOgVC3J3BPWJgqGmpK+BevdT7bLg/gwfypT6IS31IL/XhOjxi"
    "w6O81Md4qY+bpT7BS30JL/WlvNSX8VJfzkt9BS/1lbzUV/FSX41LfQ0u9bWjZAMzsUNp3y2CJCjghrDgdQrnyQxe"
    "74xXDHqTPNX0NVKW8f4goi+Tp7vhDcTqwTNeHd5ow7OkYGTpqnk24lPIgjep+d9cyOAtbeIp8azy96QzTs1QiqMA"
    "3jpUOwRvK7LAlfB2LfAdNrwzg3flAt+NAt+jBb63Du+z4f0s8AMs8ING4IdY4IdZ4EdY4EdZ4MdY4MdZ4CdY4CdZ"
    "4KdQ4KdR4GeOInBDNEjqOmspebTgswrxuQw+pwCVoc8LdPMFG54nNwIFfFEJ+BIKeF4JeE4Q95dz7lXwFc39VRu+"
    "lsHXc+5vIPc3Nfe36vBtG77D3N9l7u8Z7u8z9w+Y+wXm/iFz/4i5f8zcP2HunzL3z5D758j9i6Nwb5Zxb6d6JO3M"
    "O+GXiuzFDH7VRrVTDmWSwq9FjR7XSaDegUrwG4H19dsMfqfl/J7k/MGGPyYKP9fzJ6Xnz2064i8U8Vcb/qZUvahV"
    "/T1XtRr+oVX904Z/ZfDvXNV/UNV/tar/1WWLirXlGPWphclWbJIzORabuTY5Ds/InByPTZInJ2CT/MmJ2CSFchI2"
    "yaI8BpskUlrYJJdyMjZJpzwWm4syOQWP6zM5FY8jve4ol/ENQD0l96gXkULciQ/CLvUctOQ0NaL9oDxOHTI5XX3S"
    "O2esB8gZquNos1lyph47i8bOVp9tzljMifTlHJwJE1QK+kM/kMfjOV4sJamciyf4LtoXRlGA71uq8wTVqVLV+Khb"
    "I+chD2ZCzifXC+hWJ+KtdErkQoyYlMmT8IiJkSerVl2eQvGnmtycZnJzelNuzjC5OdPkZpHJTZvJTbvJzWKTm7NM"
    "bs42uTmHc9PBuTl39NzovV5iqUc8NuUSrXgpcS8jxXPzB6g7IEL1feZ7kVsM3ETNU5LL8SZPd8sVeFQVLleSh1Vo"
    "fMHoAznXavBqHrwGozEBRblWHdQs59Es56vPCpZEhTN/AS3rQlxWBTNewTRXML0Vnc7hvScvUueFTK6j1OEOlOup"
    "+UwFbxHU5Qa6RSdJqiAv7Um5UbXybblWdg3XwyYK30wL2NJQDxdzPVwyXA+XUj1spfhtph62m3ooNNXDDlMPO009"
    "XGbqwTb1sMvUw25TD5eberjC1MMergeH6+HKpnoo1kp71Xff9qA3loOd+kRepTVfTZTXYFbwLb0sPfoRJbtVz5Z1"
    "L7TQ3/DOacXXziXy2mFVLqFfR5N4DaqKrMofVlUiVQHFl42qvUaVaFIVGlUVo6rHqKoaVb1GVWRUxUZVn1EFrEqy"
    "qmQ0VZ3V2O/ZJTwZWDLVomrE2E/12CSHvjnUz5KgKgcaHmm5dLyQO9+npxqkqfbnOyGS16vD1takSFOFUSnYJ2/A"
    "rpZak/ilMhsWfyOJvIlmOtAg/iCLv3lY/C0k/laKrxvxh4z425rEDxnxh4342434O4z4O434u4z4u434e4z4e1n8"
    "fSz+fr0dWe8DRPLgSL0VlFpBZRVyMiZ3UlNaLBUgyvhvhzT0qvIh9F+uRernYlxNLO625MMNeWn4pdnQlI+QpUfJ"
    "0mO0Cuxpz+TjtExRSwqpfIIeGB3/B6eqLS0="
)


def _policies() -> list:
    return [cp.everything_saveable, cp.nothing_saveable, cp.dots_saveable,
            cp.dots_with_no_batch_dims_saveable, cp.save_only_these_names("a"),
            cp.save_any_names_but_these("a"),
            cp.save_from_both_policies(cp.dots_saveable, cp.save_only_these_names("a")),
            cp.offload_dot_with_no_batch_dims("device", "pinned_host"),
            cp.save_and_offload_only_these_names(
                names_which_can_be_saved=["a"], names_which_can_be_offloaded=["b"],
                offload_src="device", offload_dst="pinned_host"),
            cp.memory_budget(0.5), *ckptfx.memory_budget_policies([None, None], 0.5)]


def _same_objects_as_the_old_pickle() -> dict:
    mods = nn.ModuleList(ckptfx.checkpoint_wrapper(nn.Tanh(), policy=p) for p in _policies())
    x = torch.randn(2, 3, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the name policies name nothing in nn.Tanh
        for m in mods:
            m(x).sum().backward()
    return {"modules": mods,
            "hf_partial": functools.partial(ckptfx.checkpoint, policy=cp.dots_saveable)}


def _globals(data: bytes) -> set[tuple[str, str]]:
    """The (module, name) pairs a protocol-2 pickle imports when loaded."""
    return {tuple(arg.split(" ", 1)) for op, arg, _ in pickletools.genops(data)
            if op.name == "GLOBAL"}


def _old_bytes() -> bytes:
    return zlib.decompress(base64.b64decode("".join(PICKLED_BEFORE_THE_MOVE)))


def test_a_model_saved_before_the_move_loads_and_runs() -> None:
    loaded = pickle.loads(_old_bytes())
    fresh = _same_objects_as_the_old_pickle()
    assert len(loaded["modules"]) == len(fresh["modules"])
    x = torch.randn(2, 3, requires_grad=True)
    (plain,) = torch.autograd.grad(torch.tanh(x).sum(), x)
    for old, new in zip(loaded["modules"], fresh["modules"]):
        assert type(old) is type(new)  # the same checkpointed class, rebuilt
        assert old._ckptfx_options.get("policy") == new._ckptfx_options.get("policy")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = old(x)
        (g,) = torch.autograd.grad(out.sum(), x)
        assert torch.equal(g, plain)
    partial = loaded["hf_partial"]
    assert partial.func is ckptfx.checkpoint and partial.keywords == {"policy": cp.dots_saveable}


def test_wrapped_models_store_the_same_globals_as_before_the_move() -> None:
    """Every policy class, budget policies included: a model pickled now names exactly what
    one pickled before the move named, so it also loads in the earlier release."""
    old = _globals(_old_bytes())
    fresh = _same_objects_as_the_old_pickle()
    new = _globals(pickle.dumps(fresh["modules"], protocol=2))
    old_ckptfx = {g for g in old if g[0].startswith("ckptfx")} - {("ckptfx.checkpoint", "checkpoint")}
    assert {g for g in new if g[0].startswith("ckptfx")} == old_ckptfx
    assert old_ckptfx >= {("ckptfx.policies", "DotsSaveable"), ("ckptfx.budget", "MemoryBudget"),
                          ("ckptfx.budget", "BlockShare"), ("ckptfx.checkpoint", "_new_checkpointed")}


def test_a_partial_of_checkpoint_pickles_by_its_public_name_and_loads_both_ways() -> None:
    """``ckptfx.checkpoint`` reports ``ckptfx`` as its module (a public name at home), so a new
    pickle names ``ckptfx.checkpoint``, the package attribute; the old name
    (``ckptfx.checkpoint.checkpoint``, the module's attribute) still loads."""
    data = pickle.dumps(functools.partial(ckptfx.checkpoint, policy=cp.dots_saveable), protocol=2)
    assert ("ckptfx", "checkpoint") in _globals(data)
    assert pickle.loads(data).func is ckptfx.checkpoint
    assert ("ckptfx.checkpoint", "checkpoint") in _globals(_old_bytes())
    assert pickle.loads(_old_bytes())["hf_partial"].func is ckptfx.checkpoint


def test_the_policy_namespace_pickles_by_public_paths_only() -> None:
    """``checkpoint_policies`` pickles its class and its factories by the public modules
    (``ckptfx.policies``, ``ckptfx.budget``), so the next move of a file cannot break it."""
    data = pickle.dumps(cp, protocol=2)
    named = {g for g in _globals(data) if g[0].startswith("ckptfx")}
    assert ("ckptfx.policies", "_PolicyNamespace") in named
    assert ("ckptfx.policies", "save_only_these_names") in named
    assert ("ckptfx.budget", "memory_budget") in named
    assert {m for m, _ in named} == {"ckptfx.policies", "ckptfx.budget"}
    loaded = pickle.loads(data)
    assert type(loaded) is type(cp) and vars(loaded) == vars(cp)
