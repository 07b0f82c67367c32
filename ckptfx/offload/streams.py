"""The streams an offload copies on: one side stream per device, and the waits between it and
the stream the computation runs on (``ckptfx.offload``, Rules 3 and 5).

Device-generic through ``torch.Stream`` / ``torch.Event`` and ``torch.accelerator``: CUDA,
NPU and any PrivateUse1 backend take the same path.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

__all__ = ["current_stream", "serialized_copies", "side_stream"]

# One side stream per device for the life of the process, as torch's own stream pools are:
# copies to and from one device's pool buffers all run on it, in issue order (Rule 4).
_side: dict[torch.device, torch.Stream] = {}
_lock = threading.Lock()


_serial = threading.local()


@contextlib.contextmanager
def serialized_copies() -> Iterator[None]:
    """Offloads made on this thread inside the block copy on the current stream instead of a
    side stream: each copy then holds up the computation, as ckptfx's offload did before it
    overlapped. For benchmarks that measure what the overlap saves."""
    outer = getattr(_serial, "on", False)
    _serial.on = True
    try:
        yield
    finally:
        _serial.on = outer


def side_stream(device: torch.device) -> torch.Stream:
    """The stream ``device``'s offload copies run on (made on first use); the current one
    inside ``serialized_copies``."""
    if getattr(_serial, "on", False):
        return current_stream(device)
    stream = _side.get(device)
    if stream is None:
        with _lock:
            stream = _side.get(device)
            if stream is None:
                stream = _side[device] = torch.Stream(device=device)
    return stream


def current_stream(device: torch.device) -> torch.Stream:
    """The stream work on ``device`` is issued to now, on this thread (autograd's device
    threads run a node's backward on the stream its forward ran on)."""
    return torch.accelerator.current_stream(device)
