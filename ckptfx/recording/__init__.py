"""Recording a remat'd block: its ATen ops, what its backward keeps, and a replay of the rest.

``remat`` runs a block's forward under a ``Tracer`` that records each op, asks the policy per
op and keeps what the policy chose; the backward's first unpack replays only the ops the
dropped values need, from the recording. Its files, bottom to top (imports point down, to
the kernel and the policies only):

- ``signature.py``: call signatures, and caches kept per remat'd function without keeping
  anything alive;
- ``segment.py``: the recorded segment and its replay, under the forward's generator states;
- ``draws.py``: what each random op replays its generators from, by comparing their states;
- ``escapes.py``: block values whose memory leaves the dispatcher while a block is recorded;
- ``packs.py``: the residual holders, the tracer's pack hook and the values kept for the
  replay;
- ``tracer.py``: ``Tracer``, the dispatch mode that records a block;
- ``places.py``: where the tensors an unrecorded call reads live, and their checks;
- ``unrecorded.py``: later calls of a block that keeps nothing, run as plain kernel frames.

Rules (each file's own note gives the detail):

1. **A recording is replayed only where it is shown replayable**; anything it cannot vouch for
   (a buffer filled outside the dispatcher, a value handed to NumPy, a tensor subclass, a
   collective) makes the frame re-run the Python function instead, the kernel's default
   (tracer.py Rule 4); state it can check (generator states, the default dtype) is checked
   and replayed (tracer.py Rule 5, segment.py Rule 3c).
2. **The policy is asked once per op**, and its answer belongs to the op's outputs (packs.py
   Rule 2); a replay recomputes only what the kept values do not cover, at the versions the
   forward read (segment.py Rule 3).
3. **A frame is a frame**: a recording adds a replay strategy to a kernel ``Frame``; sessions,
   prefire, refill and the one-replay promise are the kernel's, unchanged.
"""
