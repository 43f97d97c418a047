"""Device: the one seam through which the guard touches the CUDA runtime.

Everything the guard's GPU path asks of CUDA goes through the functions below:
whether a tensor takes the GPU branch (`is_gpu`), capture state (`capturing`), the
current stream's identity (`stream_id`, `current_stream`) and waits between streams
(`wait`), events (`event`: record / query / synchronize), the pinned host mirror and
its async copy (`pinned`, `copy_async`), enqueueing a device op on the current stream
(`enqueue`: a kernel launch, or a small torch op on device tensors such as the
shadow's `index_fill_`), a host read that may sync (`read`), and buffers a captured
graph may still point into (`retain`).

`Cuda` is the real implementation: torch.cuda for CUDA tensors, and for CPU tensors
the immediate form (no events, no streams, ops run at once). A test installs another
backend with `use(backend)` (a context manager, or permanently until `use(None)`):
tests/devmodel.py is a model of CUDA's timing that runs the guard's GPU branch on
CPU tensors.

Keep this small: no policy lives here, only the runtime calls.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Hashable, Iterator, Optional, Protocol, Union

import torch

Where = Union[torch.Tensor, torch.device]


class Event(Protocol):
    def record(self) -> None: ...  # on the current stream
    def query(self) -> bool: ...  # complete? never waits
    def synchronize(self) -> None: ...  # wait for it (check points and exit only)


class Backend(Protocol):
    """What the guard asks of the device runtime (see the module docstring)."""

    def is_gpu(self, where: Where) -> bool: ...
    def capturing(self) -> bool: ...
    def stream_id(self, where: torch.device) -> Hashable: ...
    def current_stream(self, where: torch.device) -> Any: ...
    def wait(self, waiter: Any, waited: Any) -> None: ...
    def event(self, where: torch.device) -> Optional[Event]: ...
    def pinned(self, like: torch.Tensor) -> torch.Tensor: ...
    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...
    def enqueue(self, fn: Callable[..., Any], *args: Any) -> None: ...
    def read(self, tensor: torch.Tensor) -> list: ...
    def synchronize(self) -> None: ...


class _CudaEvent:
    """torch.cuda.Event, recorded on the current stream of its own device."""

    __slots__ = ("_event", "_device")

    def __init__(self, device: torch.device) -> None:
        self._event = torch.cuda.Event()
        self._device = device

    def record(self) -> None:
        self._event.record(torch.cuda.current_stream(self._device))

    def query(self) -> bool:
        return self._event.query()

    def synchronize(self) -> None:
        self._event.synchronize()


class Cuda:
    """The real runtime: torch.cuda for CUDA tensors; CPU tensors take the immediate form."""

    def is_gpu(self, where: Where) -> bool:
        return where.is_cuda if isinstance(where, torch.Tensor) else where.type == "cuda"

    def capturing(self) -> bool:
        # nothing captures before CUDA is initialized (a flag read: cheaper than is_available())
        return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()

    def stream_id(self, where: torch.device) -> Hashable:
        # a cheap raw-pointer read, no Stream object; a pool's device may be "cuda" with no index
        index = where.index if where.index is not None else torch.cuda.current_device()
        return torch._C._cuda_getCurrentRawStream(index)

    def current_stream(self, where: torch.device) -> Any:
        return torch.cuda.current_stream(where)

    def wait(self, waiter: Any, waited: Any) -> None:
        waiter.wait_stream(waited)

    def event(self, where: torch.device) -> Optional[Event]:
        return _CudaEvent(where) if where.type == "cuda" else None

    def pinned(self, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros(like.shape, dtype=like.dtype, pin_memory=like.is_cuda)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=src.is_cuda)

    def enqueue(self, fn: Callable[..., Any], *args: Any) -> None:
        fn(*args)  # CUDA ops are asynchronous already; CPU ones run now

    def read(self, tensor: torch.Tensor) -> list:
        return tensor.tolist()  # syncs the current stream for a CUDA tensor

    def synchronize(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()


CUDA = Cuda()
_active: Backend = CUDA
_retained: list[Any] = []  # buffers a captured graph may point into: kept for the process
_lock = threading.Lock()


def use(backend: Optional[Backend]) -> contextlib.AbstractContextManager[Backend]:
    """Install `backend` (None: the real one). As a context manager, the previous one
    comes back at the end; called plainly, it stays installed."""
    global _active
    previous = _active
    _active = backend if backend is not None else CUDA
    _bind()

    @contextlib.contextmanager
    def scope() -> Iterator[Backend]:
        global _active
        try:
            yield _active
        finally:
            _active = previous
            _bind()

    return scope()


def _bind() -> None:
    """`is_gpu`, asked of every tensor on the hot paths, is the active backend's own
    method: one call, not two."""
    global is_gpu
    is_gpu = _active.is_gpu


def backend() -> Backend:
    return _active


# The guard's calls: one global lookup and one method call each.

# Whether this tensor (or device) takes the guard's GPU branch: deferred records, events,
# streams, graphs. Under a test's model, CPU tensors do. (Bound by `_bind`.)
is_gpu: Callable[[Where], bool] = CUDA.is_gpu


def capturing() -> bool:
    return _active.capturing()


def stream_id(where: torch.device) -> Hashable:
    return _active.stream_id(where)


def current_stream(where: torch.device) -> Any:
    return _active.current_stream(where)


def wait(waiter: Any, waited: Any) -> None:
    """`waiter` runs what it gets next only after all that `waited` has enqueued so far."""
    _active.wait(waiter, waited)


def event(where: torch.device) -> Optional[Event]:
    """A new event for work on `where`; None where ops run at once (a CPU tensor)."""
    return _active.event(where)


def pinned(like: torch.Tensor) -> torch.Tensor:
    """A host buffer shaped like `like` that an async copy can land in."""
    return _active.pinned(like)


def copy_async(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Enqueue dst <- src on the current stream (host dst: read it once an event says so)."""
    _active.copy_async(dst, src)


def enqueue(fn: Callable[..., Any], *args: Any) -> None:
    """Enqueue a device op on the current stream: `fn(*args)` (a kernel launch, or a torch
    op on device tensors). Really: called now (CUDA queues it itself)."""
    _active.enqueue(fn, *args)


def read(tensor: torch.Tensor) -> list:
    """The tensor's values on the host: a check point's read, which may sync."""
    return _active.read(tensor)


def synchronize() -> None:
    """Wait for the whole device (process exit only)."""
    _active.synchronize()


def retain(obj: Any) -> None:
    """Keep `obj` (and the buffers it holds) alive for the rest of the process: a
    captured graph may still replay a probe that points into them."""
    with _lock:
        _retained.append(obj)


class Order:
    """One pool's ordering of its shadow updates after its write probes (liveness).

    A write probe reads the shadow; an alloc sets flags, a free clears them. sglang
    allocates and frees on its scheduling stream while the forward stream still
    probes, with no wait of its own, so the guard orders each shadow update after the
    write probes already enqueued: a stream wait, no host sync. Only one wait is
    needed per batch of probes: after the current stream waited for the probing
    stream, everything it enqueues later runs after those probes; it waits again only
    once a new probe was enqueued (on any stream: a probe on a new stream counts too).
    So a step costs one wait however many allocs and frees it makes."""

    __slots__ = ("stream", "_raw", "probes", "_waited")

    def __init__(self) -> None:
        self.stream: Any = None  # the stream of the latest write probe
        self._raw: Hashable = None
        self.probes = 0  # write probes enqueued (on the GPU branch)
        self._waited: dict[Hashable, int] = {}  # stream id -> `probes` when it last waited

    def probed(self, where: torch.device) -> None:
        """A write probe was enqueued on the current stream (a cheap raw-pointer test)."""
        self.probes += 1
        raw = _active.stream_id(where)
        if raw != self._raw:
            self._raw = raw
            self.stream = _active.current_stream(where)

    def after(self, where: torch.device) -> None:
        """Order what the current stream enqueues next after every probe so far."""
        stream = self.stream
        if stream is None or _active.capturing():
            return
        raw = _active.stream_id(where)
        if raw == self._raw or self._waited.get(raw) == self.probes:
            return
        _active.wait(_active.current_stream(where), stream)
        self._waited[raw] = self.probes
