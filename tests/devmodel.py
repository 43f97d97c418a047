"""A model of the parts of CUDA the guard relies on, for tests on the CPU.

A TEST DOUBLE OF THE DEVICE'S *TIMING* ONLY, not of the pools: the real sglang pool
and allocator classes stay real, and their own tensor ops run at once as always. What
is modelled is what the guard enqueues through `sglang_oobguard.probes.device`:

- Streams are queues of ops (closures). Ops run only when the model advances: the test
  calls `run()` / `synchronize()`, or `host_step()` at a step boundary, which runs the
  device up to `lag` steps behind the host. Across streams the only order is what
  events and `wait_stream` impose: `pick` chooses which runnable stream goes next and
  by default prefers the newest stream (adversarial: an unordered other stream's ops
  run first).
- Events complete only when the device reaches them; a mirror read before its copy ran
  shows the old contents; `Event.synchronize` runs the device up to the event.
- A graph (`with model.graph() as g`) records the ops enqueued during capture (they do
  not run) and the buffers they read and write, held weakly: data_ptr, nbytes, and a
  weakref to the storage. `g.replay()` fails the test (`GraphError`) if any of them was
  freed, reallocated or resized since capture, then enqueues the ops again on the
  current stream.
- Every CPU tensor takes the guard's GPU branch (`is_gpu`), so the probe kernels run
  (in Triton's interpreter, TRITON_INTERPRET=1) when the model runs them.

What it cannot show: a device-side assert's trap (the interpreter asserts nothing),
real concurrency inside one kernel or between streams (ops run one at a time), and
timings.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

from sglang_oobguard.probes import device


class GraphError(AssertionError):
    """A replay would read a buffer that was freed, moved or resized since capture."""


class Stream:
    def __init__(self, model: "Model", name: str) -> None:
        self.model, self.name = model, name
        self.queue: list[Op] = []
        self.enqueued = 0  # ops ever enqueued
        self.done = 0  # ops run (in order)

    def wait_stream(self, other: "Stream") -> None:
        self.model.wait(self, other)

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


@dataclass
class Op:
    run: Callable[[], None]
    epoch: int
    ready: Callable[[], bool] = lambda: True  # a wait: runnable only once its target ran
    label: str = ""


class Event:
    """An event: complete once the device ran its latest record (never recorded: complete)."""

    def __init__(self, model: "Model") -> None:
        self.model = model
        self.generation = 0
        self.completed = 0

    def record(self) -> None:
        self.generation += 1
        gen = self.generation
        self.model.counts["records"] += 1

        def mark() -> None:
            self.completed = max(self.completed, gen)

        self.model.enqueue_op(mark, "event")

    def query(self) -> bool:
        self.model.counts["queries"] += 1
        return self.completed >= self.generation

    def synchronize(self) -> None:
        self.model.counts["event_syncs"] += 1
        self.model.run(until=self.query)
        if not self.query():
            raise AssertionError("event.synchronize: the device cannot reach the event (a wait that never ends)")


@dataclass
class _Buffer:
    """A captured buffer, held weakly: the storage and where its bytes were."""

    storage: "weakref.ref[torch.UntypedStorage]"
    ptr: int
    nbytes: int
    offset: int
    size: tuple
    stride: tuple
    dtype: torch.dtype
    label: str

    @classmethod
    def of(cls, t: torch.Tensor, label: str) -> "_Buffer":
        s = t.untyped_storage()
        return cls(weakref.ref(s), s.data_ptr(), s.nbytes(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
                   t.dtype, label)

    def tensor(self) -> torch.Tensor:
        s = self.storage()
        if s is None:
            raise GraphError(f"graph replay: captured buffer {self.label} was freed")
        if s.nbytes() != self.nbytes:
            raise GraphError(f"graph replay: captured buffer {self.label} resized ({self.nbytes} -> {s.nbytes()} bytes)")
        if s.data_ptr() != self.ptr:
            raise GraphError(f"graph replay: captured buffer {self.label} moved ({self.ptr:#x} -> {s.data_ptr():#x})")
        return torch.empty(0, dtype=self.dtype).set_(s, self.offset, self.size, self.stride)


def _weaken(obj: Any, buffers: list[_Buffer], label: str) -> Any:
    """`obj` with every tensor in it replaced by a weak `_Buffer` (the graph holds no reference)."""
    if isinstance(obj, torch.Tensor):
        buf = _Buffer.of(obj, label)
        buffers.append(buf)
        return buf
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)._make(_weaken(x, buffers, f"{label}.{name}") for name, x in zip(obj._fields, obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_weaken(x, buffers, f"{label}[{i}]") for i, x in enumerate(obj))
    if isinstance(obj, dict):
        return {k: _weaken(v, buffers, f"{label}[{k!r}]") for k, v in obj.items()}
    return obj


def _strengthen(obj: Any) -> Any:
    if isinstance(obj, _Buffer):
        return obj.tensor()
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)._make(_strengthen(x) for x in obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_strengthen(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _strengthen(v) for k, v in obj.items()}
    return obj


@dataclass
class _Captured:
    fn: Any  # a function, or ("method", weak self, name) for a tensor's bound method
    args: tuple
    label: str


class Graph:
    def __init__(self, model: "Model") -> None:
        self.model = model
        self.ops: list[_Captured] = []
        self.buffers: list[_Buffer] = []

    def add(self, fn: Callable[..., Any], args: tuple, label: str) -> None:
        self_ = getattr(fn, "__self__", None)
        if isinstance(self_, torch.Tensor):  # a tensor's method (counter.fill_): hold the tensor weakly too
            fn = ("method", _weaken(self_, self.buffers, f"{label}.self"), fn.__name__)
        self.ops.append(_Captured(fn, _weaken(args, self.buffers, label), label))

    def check(self) -> None:
        """GraphError unless every captured buffer is still where (and as large as) it was."""
        for buf in self.buffers:
            buf.tensor()

    def replay(self) -> None:
        self.check()
        self.model.counts["replays"] += 1
        for op in self.ops:
            fn, args = op.fn, op.args
            if isinstance(fn, tuple):
                fn = getattr(fn[1].tensor(), fn[2])
            self.model.enqueue_op(lambda fn=fn, args=args: fn(*_strengthen(args)), f"replay {op.label}")


class Model:
    """The device model: install with `with Model(lag=1) as model:` (see the module docstring)."""

    def __init__(self, lag: int = 0, pick: Optional[Callable[[list[Stream]], Stream]] = None,
                 eager: bool = False) -> None:
        self.lag = lag
        self.eager = eager  # run every op as soon as it is enqueued (a device that keeps pace with the host)
        self._running = False
        self.epoch = 0  # host steps ended so far
        self.pick = pick or (lambda runnable: runnable[-1])  # newest stream first: adversarial
        self._names = itertools.count()
        self.default = Stream(self, "default")
        self.streams: list[Stream] = [self.default]
        self.current = self.default
        self.capture: Optional[Graph] = None
        self.counts: dict[str, int] = {"waits": 0, "launches": 0, "ops": 0, "copies": 0, "records": 0,
                                       "queries": 0, "event_syncs": 0, "replays": 0, "reads": 0}
        self.log: list[str] = []  # labels of the ops run, in the order the device ran them
        self._scope: Optional[contextlib.AbstractContextManager] = None

    # -- installing -------------------------------------------------------------
    def __enter__(self) -> "Model":
        self._scope = device.use(self)
        self._scope.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._scope is not None
        self._scope.__exit__(*exc)

    # -- streams and the host's view ---------------------------------------------
    def new_stream(self, name: Optional[str] = None) -> Stream:
        stream = Stream(self, name or f"s{next(self._names)}")
        self.streams.append(stream)
        return stream

    @contextlib.contextmanager
    def stream(self, stream: Stream) -> Iterator[Stream]:
        previous, self.current = self.current, stream
        try:
            yield stream
        finally:
            self.current = previous

    @contextlib.contextmanager
    def graph(self) -> Iterator[Graph]:
        assert self.capture is None, "nested capture"
        self.capture = Graph(self)
        try:
            yield self.capture
        finally:
            self.capture = None

    def enqueue_op(self, run: Callable[[], None], label: str, ready: Callable[[], bool] = lambda: True) -> None:
        stream = self.current
        stream.queue.append(Op(run, self.epoch, ready, label))
        stream.enqueued += 1
        if self.eager and not self._running:
            self.run()

    def host_step(self) -> None:
        """The host ended a forward step: the device runs until it is `lag` steps behind."""
        self.epoch += 1
        self.run(epoch=self.epoch - 1 - self.lag)

    # -- the device ---------------------------------------------------------------
    def _runnable(self, epoch: Optional[int]) -> list[Stream]:
        return [s for s in self.streams if s.queue and (epoch is None or s.queue[0].epoch <= epoch)
                and s.queue[0].ready()]

    def step(self, epoch: Optional[int] = None) -> bool:
        """Run one op (False: nothing can run)."""
        runnable = self._runnable(epoch)
        if not runnable:
            return False
        stream = self.pick(runnable)
        op = stream.queue.pop(0)
        previous, self.current = self.current, stream  # what an op enqueues lands on its own stream
        try:
            op.run()
        finally:
            self.current = previous
        stream.done += 1
        self.counts["ops"] += 1
        self.log.append(f"{stream.name}: {op.label}")
        return True

    def run(self, epoch: Optional[int] = None, until: Callable[[], bool] = lambda: False) -> None:
        """Run ops (of steps <= epoch, when given) until nothing can run or `until()`."""
        running, self._running = self._running, True
        try:
            while not until() and self.step(epoch):
                pass
        finally:
            self._running = running

    def pending(self) -> int:
        return sum(len(s.queue) for s in self.streams)

    # -- the Backend protocol (sglang_oobguard.probes.device) ------------------------------
    def is_gpu(self, where: Any) -> bool:
        return True

    def capturing(self) -> bool:
        return self.capture is not None

    def stream_id(self, where: torch.device) -> Stream:
        return self.current

    def current_stream(self, where: torch.device) -> Stream:
        return self.current

    def wait(self, waiter: Stream, waited: Stream) -> None:
        self.counts["waits"] += 1
        target = waited.enqueued
        previous, self.current = self.current, waiter
        try:
            self.enqueue_op(lambda: None, f"wait {waited.name}", ready=lambda: waited.done >= target)
        finally:
            self.current = previous

    def event(self, where: torch.device) -> Event:
        return Event(self)

    def pinned(self, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros(like.shape, dtype=like.dtype)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.counts["copies"] += 1
        self.enqueue(dst.copy_, src)

    def enqueue(self, fn: Callable[..., Any], *args: Any) -> None:
        label = getattr(fn, "__name__", None) or type(fn).__name__
        if args and getattr(fn, "__module__", "") == "sglang_oobguard.probes.kernels" and label == "_launch":
            label = f"launch {getattr(args[0], '__name__', args[0])}"
            self.counts["launches"] += 1
        if self.capture is not None:
            self.capture.add(fn, args, label)
            return
        self.enqueue_op(lambda: fn(*args), label)

    def read(self, tensor: torch.Tensor) -> list:
        """A host read of a device tensor: like CUDA, it waits for the current stream only."""
        self.counts["reads"] += 1
        stream = self.current
        self.run(until=lambda: not stream.queue)
        return tensor.tolist()

    def synchronize(self) -> None:
        self.run()
        assert not self.pending(), f"the device is stuck: {[(s, s.queue[0].label) for s in self.streams if s.queue]}"
