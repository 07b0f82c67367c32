"""Known ckptfx failures the fuzzer found: (seed, variant) -> reason.

test_fuzz.py checks that each still fails (xfail strict): a fix shows up as an XPASS, and
its entries are then removed here. Shrunk programs: ``python -m tests.fuzz --seed S
--programs 1``.

A. torch.func.grad over a remat'd block called twice with the same weights inside one CPU
   bf16 autocast region: autocast caches the bf16 cast of a leaf weight for the whole region,
   so the second call reads the cast made inside the first call, and the torch.func path
   calls it an outside tensor. Shrunk (seed 141)::

       def block(p, x, idx):
           return (F.linear(x, p['w2'], p['b0']),)      # stage: block(p, block(p, x))

   raises CheckpointError "the block read a tensor that the torch.func transform around the
   call tracks, from outside the block's arguments"; the plain function and the autograd
   path are fine.
B. Same setting with everything_saveable: a dead matmul on the weight plus another op; the
   replay feeds a tensor of the wrong shape to an op (RuntimeError "mat1 and mat2 shapes
   cannot be multiplied (4x8 and 4x8)" / "Expected size for first two dimensions of batch2
   tensor"). Shrunk (seed 100, ncalls=2, bf16)::

       def block(p, x, idx):
           v1 = x @ p['w1']                             # unused
           v2 = x * 1.0
           v2.masked_fill_(x > 0.5, 0.0)
           return (v2,)
"""

_A = ("A: torch.func.grad + bf16 autocast + remat block called twice with shared weights: "
      "the cached bf16 weight cast from call 1 is refused as an outside tensor in call 2")
_B = ("B: torch.func.grad + bf16 autocast + everything_saveable, block called twice: the "
      "replay feeds a wrongly shaped tensor (cached weight cast)")

KNOWN_FAILURES: dict[tuple[int, str], str] = {
    (32, "torch.func.grad remat(everything_saveable)"): _B,
    (100, "torch.func.grad remat(everything_saveable)"): _B,
    **{(seed, f"torch.func.grad remat({pol})"): _A
       for seed in (68, 141)
       for pol in ("default", "dots_saveable", "everything_saveable", "only_names")},
}
