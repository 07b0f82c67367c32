"""``remat`` under ``torch.func`` transforms, where saved-tensor hooks cannot run.

Inside ``grad``, ``vjp``, ``jacrev`` and the others, torch's checkpoint fails and the
kernel's hooks are refused, so a remat call becomes one ``autograd.Function`` whose backward
replays the block. Its files, bottom to top (imports point down, to the kernel and the
policies only):

- ``block.py``: one remat call as a function of a flat tuple of tensors, and the dispatch
  modes that keep its values in the forward and hand them back in the replay;
- ``backward.py``: ``RematFunction``, one replay and one gradient per use;
- ``call.py``: the entry ``remat`` takes under a transform, and the modules a block reads.

Rules (call.py's note gives the detail):

1. **Exact under every transform**: gradients equal the plain function's bit for bit; forward
   mode and ``vmap`` run the block op by op (call.py Rule 1).
2. **Remat'd where it saves memory**: under reverse-mode transforms the policy decides what is
   kept, as on the kernel's path.
3. **Autocast's cast cache is honoured**: every use of a weight sees the cast the plain
   function would (call.py Rule 6).
"""
