"""Offloaded residuals: moved to host memory while the forward runs on, brought back ahead of
the backward that reads them, on a side stream, so the copies hide under the computation.

A remat policy decides *what* is offloaded (an ``Offload`` answer: JAX's offload policies,
``save_and_offload_only_these_names``, torch SAC's ``*_CPU_OFFLOAD``, or a memory budget with
an offload share); this package decides *how*, for the packs of ``ckptfx.recording.packs``.

- ``groups.py``: a block call's offloaded residuals (``HostGroup``), the ``HostResidual`` each
  saved tensor is packed into, the reload, the prefetch chain and session retention.
- ``pool.py``: the host buffers, reused across steps; ``offload_pool_stats``,
  ``empty_offload_pool``.
- ``streams.py``: the side stream of each device; ``serialized_copies`` for benchmarks.
- ``compiled.py``: ``offload_in_compile``, the opt-in under which ``torch.compile``'s
  partitioner moves what remat policies offload (its own Rules; ``ckptfx.lowering`` Rule 4).

Rules

1. What is offloaded: a value the policy answers ``Offload`` for, in accelerator memory, of at
   least ``Offload.min_bytes`` bytes. Block arguments (inputs, parameters, outside tensors and
   views of them) never are: a block refers to them and never copies them (packs.py Rule
   2). On the CPU an ``Offload`` keeps the value as it is (it is in host memory already).
2. One copy per storage: saved views of one storage, at one version, in one block call share
   one host copy of the whole storage (q, k and v split from one projection are copied once),
   and each comes back with its own size, stride and offset, so the backward reads the layout
   the forward saved (layout changes rounding: bitwise needs it). A value that is not just
   its storage's bytes under its strides stays on the device: a tensor subclass (DTensor),
   a sparse or other non-strided layout, a lazily conjugated or negated view, a quantized
   tensor, and a view whose storage is not a whole number of its elements or is empty.
3. Out: the copy is queued on the device's side stream (``streams.side_stream``) after that
   stream waited for the current one, and the device source is recorded on the side stream
   (``record_stream``) and let go: the allocator reuses its memory only after the copy has
   run, and frees it as soon as the block's own references are gone, never waiting on the
   host. An op of the block that writes a storage whose copy may still be queued makes the
   current stream wait for the copy first (the tracer asks ``before_write``), and so does a
   block output whose storage is being copied when the block returns (the caller may write
   it).
4. Host buffers come from a pool per device, kind of memory (pinned for
   ``dst="pinned_host"``) and stream, in size classes, and go back to it when their group
   dies: the next step reuses them. Every copy in or out of one pool's buffers runs on that
   pool's stream, in issue order, so reuse needs no host synchronisation. The pool caches
   at most twice the bytes its residuals ever held at once. A buffer that cannot be
   allocated is a ``CheckpointError`` that says what to do. ``offload_pool_stats`` reports
   the pool (in size-class bytes); ``empty_offload_pool`` frees its cached buffers.
5. Back: the first read of one of a block call's offloaded values (autograd unpacking a
   residual, the replay reading a kept value, a prefire's replay) reloads every buffer of its
   group at once: device buffers allocated on the current stream (the one that reads them),
   the side stream waits for it, the copies, one event, and each buffer recorded on the side
   stream (freed unread, its memory still waits for the copy into it); each read makes the
   reading stream wait for that event (device-side, never a host sync), and a read on
   another stream than the allocating one records that stream too. The same reload issues
   the reloads of up to ``Offload.prefetch`` groups made before it on the forward's thread
   and never reloaded: the blocks the backward reaches next, whose copies then run under
   this block's backward. A prefetch registers nothing to a session and stops at a block
   registered to another session (another micro-batch's); outside sessions, with two
   graphs' forwards interleaved on one thread, it may reload the other graph's last block
   early (held until that graph's backward reads it).
6. How long a reload stays: for a frame registered to a recompute session (a prefire, a
   ``recompute_session_ctx``, ``vjp_split``, ``ckptfx.pipelining``), until the session is
   cleared, so dx and every dw call read one reload. Otherwise each buffer is held until every
   residual that refers to it has been read once (by autograd's unpack; by the replay only
   for a value kept just for the replay: a value both read leaves the replay's read
   uncounted, so autograd's unpack after it finds the same reload), then only weakly (while
   autograd still holds the tensors it unpacked); a later read that finds it gone (a second
   backward with ``retain_graph``) reloads that buffer.
7. Nothing outlives the graph: a group belongs to the residuals of one block call and dies
   with them, handing its host buffers back to the pool; its device memory went to the
   allocator with its streams recorded (Rules 3 and 5), so nothing waits on the host.
8. A saved tensor modified in place after it was offloaded (by the block, or a block output by
   the caller while it still holds it) is refused when the backward reads it, with a
   ``CheckpointError``, where autograd raises for a saved tensor modified in place; the host
   copy would still hold the saved value, but ckptfx does not differ from torch silently.
9. A block output whose storage was offloaded (the block saved it, or a view of it) is read
   where the caller still holds it, unmodified, when the backward needs it: it is in device
   memory anyway, so it is not reloaded (its copy out was made before the block knew it
   was an output).
"""

from ckptfx.offload.compiled import offload_in_compile
from ckptfx.offload.groups import HostGroup, HostResidual, group_for
from ckptfx.offload.pool import OffloadPoolStats, empty_offload_pool, offload_pool_stats

__all__ = ["HostGroup", "HostResidual", "OffloadPoolStats", "empty_offload_pool", "group_for",
           "offload_in_compile", "offload_pool_stats"]
