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

Start-up is the one moment another local user could reach in: the driver listens on a
loopback port that anyone on the machine can connect to. The workers prove they are ours with
a random key (``multiprocessing``'s HMAC challenge, both ways) that travels in a file only this
user can read, never on a command line (every user can read ``/proc/PID/cmdline``) nor in the
environment (MPICH's ``mpiexec`` sends its environment to its proxies over a TCP socket
listening on every interface); the file is removed once every worker has connected. Nothing a
peer sends is unpickled before it has proved it holds the key, and its rank is read as plain
digits (:func:`accept_workers`). vLLM's CVE-2025-30165 and CVE-2025-47277 are this class of bug.
"""

from __future__ import annotations

import logging
import os
import secrets
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge, wait
from pathlib import Path

import numpy as np

from refengine.core.model_runner import ModelRunner

logger = logging.getLogger(__name__)

#: Seconds to wait, all told, for the workers to connect, load their shares and compile their kernels.
STARTUP_TIMEOUT_S = 900
#: Seconds a connecting peer has to prove it holds the key and say its rank (a worker does so at once).
HANDSHAKE_TIMEOUT_S = 10


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
        WorkerError: a worker failed while loading (its traceback in the message), ``mpiexec``
            exited before every worker connected (its exit code in the message), or start-up
            took longer than ``STARTUP_TIMEOUT_S``.
    """

    _exit_code = None  # mpiexec's, once it has ended

    def __init__(self, args, config, dequantize_gguf: bool):
        n = config.tensor_parallel_size
        self.model = self.kv_cache = None  # in the workers
        self.lora_manager = None  # the engine refuses LoRA under tensor parallelism
        self.xp, self.block_size = np, config.block_size
        self._conns, self._launcher = [], None
        meeting = None  # on a GPU: NCCL's unique id, made here and given to every rank
        if config.device == "cuda":
            from cupy.cuda import nccl

            meeting = nccl.get_unique_id()
        shares = cpu_shares(n) if config.device == "cpu" else [None] * n
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        authkey = secrets.token_bytes(32)
        # the key goes in a file only this user can read (mkstemp makes it mode 0600); its path,
        # which is no secret, is what goes on mpiexec's command line
        key_fd, key_file = tempfile.mkstemp(prefix="refengine-tp-key-")
        try:
            with os.fdopen(key_fd, "wb") as f:
                f.write(authkey)
            with socket.create_server(("127.0.0.1", 0)) as server:
                host, port = server.getsockname()
                # MPI's launcher starts the N ranks (fresh interpreters: no inherited threads, locks or user script)
                self._launcher = subprocess.Popen([mpiexec(), "-n", str(n), sys.executable, "-m",
                                                   "refengine.core.worker", f"{host}:{port}", key_file])
                try:
                    self._conns = accept_workers(server, authkey, n, self._launcher, deadline)
                except BaseException:
                    self.shutdown(wait_s=0)
                    raise
        finally:
            os.unlink(key_file)  # every worker has read it, or start-up has failed
        for rank, conn in enumerate(self._conns):
            conn.send((meeting, config, dequantize_gguf, shares[rank]))
        try:
            if config.num_kv_blocks is None:  # GPU: the pool every worker has room for
                blocks = min(self._expect(c, "blocks", deadline) for c in self._conns)
                config = args.create_engine_config(config.model_dir, config.model_config, num_gpu_blocks=blocks)
                for c in self._conns:
                    c.send(config)
            self.workers = [self._expect(c, "ready", deadline) for c in self._conns]
        except BaseException:
            self.shutdown(wait_s=0)
            raise
        self.config = config
        logger.info("tensor parallelism: %d workers %s", n,
                    ", ".join(f"#{w['rank']} pid {w['pid']} heads {w['q_heads'].start}-{w['q_heads'].stop - 1}"
                              for w in self.workers))

    def _expect(self, conn, kind: str, deadline: float):
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            raise WorkerError(f"a tensor-parallel worker did not finish starting in {STARTUP_TIMEOUT_S} s")
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

    def run_model(self, ids: np.ndarray, positions: np.ndarray, meta, rows: np.ndarray,
                  lora=None) -> np.ndarray:
        """One step on every worker: ``logits [len(rows), vocab]`` float32 from worker 0.
        ``lora`` is always None here (the engine refuses adapters under tensor parallelism).

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

    def shutdown(self, wait_s: float = 15) -> None:
        """Stop every worker (idempotent): each is told to stop, then ``mpiexec`` is waited
        for ``wait_s`` seconds, and killed (with its ranks) if it has not ended."""
        for c in self._conns:
            try:
                c.send(None)
            except OSError:
                pass
        if self._launcher is not None:
            try:
                self._launcher.wait(timeout=wait_s)
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


def accept_workers(server: socket.socket, authkey: bytes, n: int, launcher: subprocess.Popen,
                   deadline: float) -> list[Connection]:
    """The ``n`` workers' connections to the listening ``server`` socket, in rank order.

    Each peer must pass ``multiprocessing``'s HMAC challenge with ``authkey`` both ways (the
    driver's :class:`multiprocessing.connection.Listener` does the same) and then send its rank
    as decimal digits, all within ``HANDSHAKE_TIMEOUT_S``; the rank is read as bytes, so nothing
    a peer sends is ever unpickled here. A peer that fails (a wrong key, silence, a pickle for a
    rank, a rank taken or out of range) is logged, closed and forgotten, and the wait goes on.

    Args:
        server: a listening TCP socket (blocking).
        authkey: the key the workers were given.
        n: the number of workers (ranks ``0 .. n-1``).
        launcher: ``mpiexec``'s process, watched while waiting.
        deadline: ``time.monotonic()`` by which every worker must have connected.
    Raises:
        WorkerError: the launcher exited first (its exit code in the message), or the deadline passed.
    """
    accepted: dict[int, Connection] = {}
    try:
        while len(accepted) < n:
            if launcher.poll() is not None:
                raise WorkerError(f"mpiexec exited with code {launcher.returncode} before the tensor-parallel "
                                  f"workers connected ({len(accepted)} of {n} did)")
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"tensor-parallel workers did not connect in {STARTUP_TIMEOUT_S} s "
                                  f"({len(accepted)} of {n} did)")
            if not select.select([server], [], [], min(left, 0.5))[0]:
                continue  # nobody yet: look at the launcher again
            sock, peer = server.accept()
            try:
                rank, conn = _authenticate(sock, authkey, max(0.01, min(left, HANDSHAKE_TIMEOUT_S)))
            except (OSError, EOFError, AuthenticationError, ValueError) as e:
                logger.warning("tensor parallelism: dropped a connection from %s:%d that is not a worker (%s: %s)",
                               *peer, type(e).__name__, e)
                continue
            if not 0 <= rank < n or rank in accepted:
                logger.warning("tensor parallelism: dropped a connection from %s:%d: rank %d is %s",
                               *peer, rank, "taken" if rank in accepted else f"not in 0..{n - 1}")
                conn.close()
                continue
            accepted[rank] = conn
    except BaseException:
        for conn in accepted.values():
            conn.close()
        raise
    return [accepted[r] for r in range(n)]


def _authenticate(sock: socket.socket, authkey: bytes, timeout: float) -> tuple[int, Connection]:
    """``(rank, connection)`` of an accepted socket whose peer proves it holds ``authkey`` and
    sends its rank as decimal digits within ``timeout`` seconds; ``sock`` is closed either way.

    Raises:
        AuthenticationError: a wrong key. TimeoutError: the time ran out. OSError: a rank
        message over 8 bytes, or the connection failed. EOFError: the peer hung up.
        ValueError: the rank is not decimal digits.
    """
    # a Connection reads and writes the raw descriptor, so the time limit is the kernel's:
    # past SO_RCVTIMEO / SO_SNDTIMEO a blocked read or write fails with EAGAIN (an OSError)
    with sock:
        _set_io_timeout(sock, timeout)
        conn = Connection(os.dup(sock.fileno()))
        try:
            deliver_challenge(conn, authkey)
            answer_challenge(conn, authkey)
            digits = conn.recv_bytes(maxlength=8)
            if not digits.isdigit():
                raise ValueError(f"a rank is decimal digits, got {digits!r}")
        except BlockingIOError:  # EAGAIN: SO_RCVTIMEO ran out
            conn.close()
            raise TimeoutError(f"no answer in {timeout:g} s") from None
        except BaseException:
            conn.close()
            raise
        _set_io_timeout(sock, 0)  # a step's reply may be long in coming
    return int(digits), conn


def _set_io_timeout(sock: socket.socket, seconds: float) -> None:
    """Time limit of each blocking read and write on ``sock`` (0: none), as a ``struct timeval``."""
    timeval = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


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
