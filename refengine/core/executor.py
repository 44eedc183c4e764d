"""The driver and the worker processes of ``tensor_parallel_size = N``.

The engine's process keeps everything that decides (scheduler, block manager, sampler,
detokenizer); it holds no weights. :class:`TensorParallelRunner` takes the place of
:class:`refengine.core.model_runner.ModelRunner`: it lays out each step's flat batch as the
single-process runner does and sends it to ``N`` worker processes, started with
MPI's launcher (``mpiexec -n N python -m refengine.core.worker``: fresh interpreters
that never import the user's script) and talking to it over ``multiprocessing.connection``
sockets. Each worker (:func:`refengine.core.worker.worker_main`)
holds one :class:`refengine.parallel.Partition` of the model and a KV cache of its own KV
heads with the same number of blocks (the block tables are the driver's, so one block id
means the same tokens on every worker), runs the forward pass, meeting the others in the
collectives (:mod:`refengine.parallel.communicator`), and worker 0 sends back the logits.
A step is the same bytes on every worker, so they stay in step without further messages.

On the CPU each worker is pinned to its own share of the process's cores
(``os.sched_setaffinity``), so the thread pools of two workers never fight over a core.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
from multiprocessing.connection import Listener, wait
from pathlib import Path

import numpy as np

from refengine.core.model_runner import ModelRunner

logger = logging.getLogger(__name__)

#: Seconds to wait for the workers to load their shares and compile their kernels.
STARTUP_TIMEOUT_S = 900


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed or died; the message carries its traceback."""


def cpu_shares(world_size: int, cpus: list[int] | None = None) -> list[list[int] | None]:
    """Each worker's cores: the usable CPUs (``os.sched_getaffinity``) cut into ``world_size``
    equal contiguous shares, the remainder unused; None for every worker (no pinning) when
    there are fewer CPUs than workers."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else list(cpus)
    per = len(cpus) // world_size
    if per == 0:
        return [None] * world_size
    return [cpus[r * per:(r + 1) * per] for r in range(world_size)]


class TensorParallelRunner(ModelRunner):
    """A :class:`refengine.core.model_runner.ModelRunner` (the same ``execute``) whose forward pass
    runs on ``config.tensor_parallel_size`` worker processes.

    Args:
        args: the engine's :class:`refengine.engine_args.EngineArgs` (a GPU pool is resolved
            again with the blocks every worker has room for).
        config: the resolved config (``tensor_parallel_size > 1``).
        dequantize_gguf: as :func:`refengine.core.engine.build_model`.

    Attributes:
        config: the config the workers run with (on a GPU: with the agreed ``num_kv_blocks``).
        workers: each worker's ``info``: rank, pid, cpus, its heads, features and vocabulary
            rows, and the formats its first layer's matrices are held in (``layer0_formats``).
    Raises:
        RuntimeError: no ``mpiexec`` (MPI is not installed).
        WorkerError: a worker failed while loading (its traceback in the message).
    """

    _exit_code = None  # mpiexec's, once it has ended

    def __init__(self, args, config, dequantize_gguf: bool):
        n = config.tensor_parallel_size
        self.model = self.kv_cache = None  # in the workers
        self.xp, self.block_size = np, config.block_size
        self._conns, self._launcher = [], None
        meeting = None  # on a GPU: NCCL's unique id, made here and given to every rank
        if config.device == "cuda":
            from cupy.cuda import nccl

            meeting = nccl.get_unique_id()
        shares = cpu_shares(n) if config.device == "cpu" else [None] * n
        authkey = secrets.token_bytes(16)
        previous = socket.getdefaulttimeout()
        socket.setdefaulttimeout(STARTUP_TIMEOUT_S)  # the listening socket's: accept() gives up on a worker that never came
        try:
            listener = Listener(("127.0.0.1", 0), authkey=authkey)
        finally:
            socket.setdefaulttimeout(previous)
        with listener:
            host, port = listener.address
            # MPI's launcher starts the N ranks (fresh interpreters: no inherited threads, locks or user script)
            self._launcher = subprocess.Popen([mpiexec(), "-n", str(n), sys.executable, "-m", "refengine.core.worker",
                                               f"{host}:{port}", authkey.hex()])
            accepted = {}
            try:
                for _ in range(n):
                    conn = listener.accept()
                    accepted[conn.recv()] = conn  # each worker says its rank first
            except OSError as e:
                self._conns = list(accepted.values())
                self.shutdown()
                raise WorkerError(f"tensor-parallel workers did not connect in {STARTUP_TIMEOUT_S} s "
                                  f"({len(accepted)} of {n} did): {e}") from e
        self._conns = [accepted[r] for r in range(n)]
        for rank, conn in enumerate(self._conns):
            conn.send((meeting, config, dequantize_gguf, shares[rank]))
        try:
            if config.num_kv_blocks is None:  # GPU: the pool every worker has room for
                blocks = min(self._expect(c, "blocks") for c in self._conns)
                config = args.create_engine_config(config.model_dir, config.model_config, num_gpu_blocks=blocks)
                for c in self._conns:
                    c.send(config)
            self.workers = [self._expect(c, "ready") for c in self._conns]
        except BaseException:
            self.shutdown()
            raise
        self.config = config
        logger.info("tensor parallelism: %d workers %s", n,
                    ", ".join(f"#{w['rank']} pid {w['pid']} heads {w['q_heads'].start}-{w['q_heads'].stop - 1}"
                              for w in self.workers))

    def _expect(self, conn, kind: str):
        if not conn.poll(STARTUP_TIMEOUT_S):
            raise WorkerError(f"a tensor-parallel worker sent nothing in {STARTUP_TIMEOUT_S} s while starting")
        msg = self._recv(conn)
        if msg[0] != kind:
            raise WorkerError(f"a tensor-parallel worker sent {msg[0]!r} while starting, expected {kind!r}")
        return msg[1]

    def _recv(self, conn):
        rank = self._conns.index(conn)
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the socket closed or reset: the process is gone
            self.shutdown()
            raise WorkerError(f"tensor-parallel worker {rank} died (mpiexec exit code "
                              f"{self._exit_code})") from None
        if isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "error":
            self.shutdown()
            raise WorkerError(f"tensor-parallel worker {rank} failed:\n{msg[1]}")
        return msg

    def run_model(self, ids: np.ndarray, positions: np.ndarray, meta, rows: np.ndarray) -> np.ndarray:
        """One step on every worker: ``logits [len(rows), vocab]`` float32 from worker 0.

        Raises:
            WorkerError: a worker failed or died during the step (every worker is stopped).
        """
        if not self._conns:
            raise WorkerError("the tensor-parallel workers have been stopped")
        step = (ids, positions, meta, rows)
        for rank, c in enumerate(self._conns):
            try:
                c.send(step)
            except OSError:
                self.shutdown()
                raise WorkerError(f"tensor-parallel worker {rank} died (mpiexec exit code {self._exit_code})") from None
        replies = {}
        pending = list(self._conns)
        while pending:  # every worker answers, so a failure anywhere is seen now, not as a hang
            for c in wait(pending):
                replies[self._conns.index(c)] = self._recv(c)
                pending.remove(c)
        return replies[0]

    def shutdown(self) -> None:
        """Stop every worker (idempotent): each is told to stop, then ``mpiexec`` is waited
        for, and killed (with its ranks) if it does not end."""
        for c in self._conns:
            try:
                c.send(None)
            except OSError:
                pass
        if self._launcher is not None:
            try:
                self._launcher.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._launcher.kill()
                self._launcher.wait(timeout=5)
            self._exit_code = self._launcher.returncode
        for c in self._conns:
            c.close()
        self._conns, self._launcher = [], None

    def __del__(self):
        if getattr(self, "_launcher", None) is not None:
            self.shutdown()


def mpiexec() -> str:
    """The ``mpiexec`` beside this interpreter (the ``mpich`` wheel installs it there), else
    the one on ``PATH``.

    Raises:
        RuntimeError: none found (``pip install 'refengine[distributed]'``).
    """
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.is_file() else shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("tensor_parallel_size > 1 needs MPI's launcher (mpiexec) and mpi4py: "
                           "pip install 'refengine[distributed]'")
    return found
