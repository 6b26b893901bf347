"""Tensor-parallel processes. Rank 0 (the driver, where `LLM` was called) owns the requests;
every step it sends the step's commands (requests added, requests aborted, "step") to the other
ranks, and every rank runs the same scheduler and the same forward on its shard (as SGLang's TP
workers do), so all ranks take the same decisions without shipping tensors. Workers are started
here (one process per rank) or by torchrun, whose ranks > 0 serve rank 0 inside `LLM()`."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.multiprocessing as mp

from flashtree.distributed import destroy_tp, init_tp, tp_broadcast_object

_STEP = [("step", None)]  # one step, nothing added or aborted, no policy decision to follow


class TPGroupStopped(RuntimeError):
    """The tensor-parallel group cannot run any more steps (the ranks may be out of step)."""


class WorkerDied(TPGroupStopped):
    """A worker process of the group is gone; the message names its rank."""


def free_port() -> int:
    """A loopback port free now (for a process group's rendezvous or a server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun(size: int) -> bool:
    """True when this process is one of torchrun's `size` ranks."""
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) == size


@dataclass
class TPGroup:
    """The driver's view of the group: the worker processes it started (none under torchrun)."""

    size: int
    processes: list = field(default_factory=list)  # rank r is processes[r - 1]
    closed: bool = False
    last_sent: list = field(default_factory=lambda: _STEP)  # a repeat sends only a header

    @staticmethod
    def start(size: int, build_engine: Callable[[dict], Any], engine_kwargs: dict,
              device_type: str) -> TPGroup:
        """Join (torchrun) or start the group; every other rank builds its engine with
        `build_engine(engine_kwargs)` (a module-level function: it is pickled to spawned
        ranks). On torchrun ranks > 0 this serves rank 0 and exits when rank 0 shuts down."""
        backend = "nccl" if device_type == "cuda" else "gloo"
        device = torch.device("cuda", 0) if backend == "nccl" else None
        if under_torchrun(size):
            rank = int(os.environ["RANK"])
            if rank > 0:
                local = int(os.environ.get("LOCAL_RANK", rank))
                _worker_main(rank, local, size, backend, "env://", build_engine, engine_kwargs)
                sys.exit(0)
            init_tp(0, size, backend, "env://", device=device)
            return TPGroup(size)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker_main, args=(rank, rank, size, backend, init_method,
                                                        build_engine, engine_kwargs), daemon=True,
                             name=f"flashtree-tp{rank}") for rank in range(1, size)]
        for p in procs:
            p.start()
        group = TPGroup(size, procs)
        try:
            init_tp(0, size, backend, init_method, device=device)
        except Exception as e:
            group.stop(e)
        return group

    def raise_if_dead(self, cause: BaseException | None = None) -> None:
        """Raise WorkerDied naming the first worker process that is gone."""
        for rank, p in enumerate(self.processes, start=1):
            p.join(timeout=0.5 if cause is not None else 0)
            if not p.is_alive():
                self.closed = True
                raise WorkerDied(
                    f"tensor-parallel worker rank {rank} (pid {p.pid}) died with exit code "
                    f"{p.exitcode}; the engine stopped") from cause

    def send(self, ops: list) -> None:
        if self.closed:
            raise TPGroupStopped("the tensor-parallel group is stopped")
        self.raise_if_dead()
        try:
            tp_broadcast_object(ops, usual=self.last_sent)
            self.last_sent = ops
        except Exception as e:
            self.stop(e)

    def stop(self, cause: BaseException) -> None:
        """A step or a collective failed: the ranks may be out of step, so none may run again.
        Kill the workers and raise, naming a dead worker when there is one."""
        try:
            self.raise_if_dead(cause)
        finally:
            self.closed = True
            for p in self.processes:
                p.kill()
        raise TPGroupStopped(
            f"tensor-parallel step failed ({type(cause).__name__}: {cause}); the group is "
            "stopped") from cause

    def shutdown(self) -> None:
        if not self.closed:
            try:
                self.send([("shutdown",)])
            except TPGroupStopped:
                pass  # a worker is gone: nothing left to tell
            self.closed = True
        for p in self.processes:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        destroy_tp()


class TPDriverEngine:
    """Rank 0's engine: the local LLMEngine plus the command stream every other rank replays.
    A request is validated locally before anything is sent, so ranks never disagree on ids."""

    def __init__(self, engine, group: TPGroup) -> None:
        self._engine, self._group, self._ops = engine, group, []

    def add_request(self, prompt_ids, params):
        seq = self._engine.add_request(prompt_ids, params)
        self._ops.append(("add", list(prompt_ids), params))
        return seq

    def abort(self, seq) -> None:
        self._engine.abort(seq)
        self._ops.append(("abort", seq.seq_id))

    def call_on_workers(self, fn: Callable, *args) -> None:
        """Run `fn(engine, *args)` on every other rank's engine now, between steps (a
        module-level function: it is pickled), e.g. to wrap their drafters as rank 0's is."""
        ops, self._ops = [*self._ops, ("call", fn, args)], []
        self._group.send(ops)

    def step(self):
        # The adaptive policy's decision rides in the step's command (no collective of its
        # own); it changes seldom, so most steps repeat the last command list: a header only.
        policy = self._engine.policy
        decisions = None if policy is None else policy.decisions()
        ops, self._ops = [*self._ops, ("step", decisions)], []
        self._group.send(ops)
        try:
            return self._engine.step()
        except Exception as e:  # noqa: BLE001 - workers may be stuck in a collective
            self._group.stop(e)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def __setattr__(self, name: str, value) -> None:
        # Public attributes are the local engine's (e.g. `policy`), as reads are.
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._engine, name, value)


def serve_steps(engine) -> None:
    """A worker's loop: replay rank 0's commands until it shuts down."""
    seqs: dict = {}
    last = _STEP  # what rank 0 sent last: its repeat arrives as a header only
    while True:
        last = tp_broadcast_object(usual=last)
        for op in last:
            kind = op[0]
            if kind == "add":
                seq = engine.add_request(op[1], op[2])
                seqs[seq.seq_id] = seq
            elif kind == "abort":
                seq = seqs.pop(op[1], None)
                if seq is not None:
                    engine.abort(seq)
            elif kind == "call":
                op[1](engine, *op[2])
            elif kind == "step":
                if op[1] is not None:
                    engine.policy = op[1]  # rank 0's decisions (`policy.FollowedPolicy`)
                engine.step()  # an error here ends this worker; rank 0 reports its rank
                seqs = {i: s for i, s in seqs.items() if not s.is_finished}
            elif kind == "shutdown":
                return


def _worker_main(rank: int, local: int, size: int, backend: str, init_method: str,
                 build_engine: Callable[[dict], Any], engine_kwargs: dict) -> None:
    """A worker rank; `local` is its index on its own node (its GPU under NCCL)."""
    kwargs = dict(engine_kwargs)
    device = None
    if backend == "nccl":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        kwargs["device"] = str(device)
    init_tp(rank, size, backend, init_method, device=device)
    try:
        serve_steps(build_engine(kwargs))
    finally:
        destroy_tp()
