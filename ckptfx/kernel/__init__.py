"""The checkpoint kernel: frames, their replays, and scheduled recomputation over them.

Every checkpointed call, ``ckptfx.checkpoint``'s and ``remat``'s alike, is a ``Frame``; the
rest of ckptfx decides *what* a frame keeps and *when* it replays, and this package makes the
replay exact. Its files, bottom to top (imports point down; nothing here imports a policy, a
recorder, the split or a front end):

- ``replay_env.py``: ``ReplayEnv``, what must be the same when a block is replayed (RNG
  states, autocast, the device context), entered and left around each replay;
- ``last_op.py``: the proof that the last op saving a tensor writes none of its arguments, so
  early stop needs no dispatch mode;
- ``frame.py``: ``Frame`` and ``Holder``, the saved-tensor hooks, ``CheckpointError``; its Rules
  note is the kernel's contract;
- ``debug.py``: ``debug=True``'s op logs;
- ``collectives.py``: collectives inside a block, logged in the forward and answered from the
  log in the replay;
- ``function_replay.py``: the default replay, re-running the block's Python function;
- ``handles.py``: the handle collector, which frames a forward made, for a scheduler;
- ``refill.py``: ``refill_outputs``, block outputs that later ops save, refilled by the replay;
- ``fsdp.py``: FSDP2 parameters unsharded before a module's prefire;
- ``session.py``: sessions, prefire and clear, the control plane over the frames;
- ``forward.py``: ``run_checkpointed``, one checkpointed call of a Python function.

Rules (each file's own note gives the detail):

1. **Exact or refused.** A replay runs as the forward ran and is checked against it; a
   mismatch is a ``CheckpointError``, never a wrong tensor (frame.py Rules 5, 6).
2. **The unpack hook is the hot path**: it reads attributes only, no lock, no ContextVar, no
   registry, since autograd may run it on a device thread that never saw the caller's context
   (frame.py Rule 4). The session a frame serves is bound to the frame by the control plane
   (session.py Rule 3), which owns the only lock.
3. **One replay per key**: per GraphTask without a session, as torch does; per session with
   one, however many backward calls read the frame (frame.py Rule 3, session.py Rule 1).
4. **Nothing leaks**: holders keep their frame, the graph keeps the holders, and nothing else
   holds a frame (frame.py Rule 1, session.py Rule 5).
5. **No clock**: what a replay runs, keeps and raises depends on the program, never on timing
   (frame.py Rule 6).
"""
