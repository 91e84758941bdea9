"""Run a function on N gloo ranks (one forked process each) and return every rank's result.

A test body then reads like a single-process test::

    results = run_ranks(_check_logps, world_size=4, tp=2)
    assert results[0] == results[1]

The function must be defined at module level; it runs with RANK / WORLD_SIZE / MASTER_* set as
torchrun would set them, so it calls the same ``initialize_distributed`` as the real entry point.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import time
import traceback
from collections.abc import Callable
from typing import Any

from dpo_megatron.parallel.layout import free_port

# Ranks are forked from a forkserver: a clean single-threaded process that has imported torch
# and megatron-core once. Forking the pytest process itself is not safe: earlier in-process tests
# leave threads (tokenizers, tqdm, torch pools) whose locks a forked child can inherit held, and
# a rank then hangs in its first collective.
# Everything most ranks import is imported here once per test process, not once per rank
# (seconds of CPU per rank for the trainer and for transformers); none of
# these modules starts a thread at import.
_PRELOAD = [
    # first: its import runs the entry points' set-up before megatron-core's import
    # (dpo_megatron.compat.before_megatron_import: no torch.compile wrapping on the CPU)
    "dpo_megatron.config",
    "torch",
    "torch.distributed",
    "megatron.core.parallel_state",
    "megatron.core.models.gpt",
    "megatron.core.pipeline_parallel",
    "megatron.core.optimizer",
    "megatron.core.dist_checkpointing",
    "dpo_megatron.training.step",
    "dpo_megatron.losses",
    "dpo_megatron.data",
    "dpo_megatron.training.trainer",
    "dpo_megatron.cli.train",
    "dpo_megatron.models.conversion",
    "transformers",
    "transformers.models.auto.tokenization_auto",
]


def process_context():
    """The multiprocessing context for test processes that run torch.distributed code."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # no effect once the server runs
    return ctx


def _child(fn, rank, world_size, port, kwargs, conn):
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import gc

    import torch

    torch.set_num_threads(1)
    _shut_groups_on_destroy()
    # The preloaded modules' objects (a few hundred thousand) leave the collector's view: a full
    # collection walks every tracked object, and megatron-core runs one per optimizer
    # sharded_state_dict (each checkpoint save and load), a noticeable share of a rank's CPU.
    gc.freeze()
    # Results go as plain pickled bytes: multiprocessing's own pickler would hand tensors over as
    # shared-memory file descriptors that the parent fetches from this process afterwards, and
    # a rank that has exited by then fails the run ("Connection reset by peer").
    try:
        result = fn(**kwargs)
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException:  # report everything, including assertion errors, to the parent
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    finally:
        conn.close()
        try:
            from dpo_megatron.parallel import destroy_distributed

            destroy_distributed()
        except Exception:
            pass


PORT_TAKEN = "EADDRINUSE"
"""In a rank's error when another process bound the rendezvous port between ``free_port()`` and
the rank's TCPStore (parallel test workers, a benchmark beside the suite): nothing of ``fn`` ran
past process-group set-up, so the ranks are started again on a new port."""


def run_ranks(
    fn: Callable[..., Any], world_size: int, timeout: float = 600.0, **kwargs
) -> list[Any]:
    """Run ``fn(**kwargs)`` on ``world_size`` ranks; return the list of results by rank.

    Raises:
        RuntimeError: with the failing rank's traceback, or on timeout (all ranks are killed).
    """
    for attempt in range(3):
        try:
            return _run_ranks_once(fn, world_size, timeout, kwargs)
        except RuntimeError as e:
            if PORT_TAKEN not in str(e) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _run_ranks_once(
    fn: Callable[..., Any], world_size: int, timeout: float, kwargs: dict
) -> list[Any]:
    ctx = process_context()
    port = free_port()
    procs, conns = [], []
    for rank in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(fn, rank, world_size, port, kwargs, child_conn))
        p.start()
        child_conn.close()
        procs.append(p)
        conns.append(parent_conn)
    results: list[Any] = [None] * world_size
    errors = []
    pending = dict(enumerate(conns))
    deadline = time.monotonic() + timeout
    try:
        # Wait on every rank at once: a rank that fails leaves the others blocked in a
        # collective, so the first error must end the run instead of waiting for them.
        while pending and not errors:
            remaining = deadline - time.monotonic()
            ready = mp_connection.wait(list(pending.values()), timeout=max(remaining, 0))
            if not ready:
                raise RuntimeError(f"ranks {sorted(pending)} gave no result within {timeout:.0f} s")
            for rank in [r for r, c in pending.items() if c in ready]:
                try:
                    status, payload = pickle.loads(pending.pop(rank).recv_bytes())
                except EOFError:  # died without reporting (killed, segfault)
                    status, payload = "error", f"exited with code {procs[rank].exitcode}"
                if status == "error":
                    errors.append(f"--- rank {rank} ---\n{payload}")
                else:
                    results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("a rank failed:\n" + "\n".join(errors))
    return results


def run_in_turn(each: Callable[..., Any], cases: dict[str, dict]) -> dict[str, Any]:
    """Inside :func:`run_ranks`: ``each(**kwargs)`` for every ``name: kwargs`` of ``cases`` in
    order, on the same ranks, megatron-core's parallel state torn down before each (a case may
    use another layout); returns ``{name: result}``. Many cases in one rank-world save a world's
    start-up and the first build's imports per case (seconds each)::

        runs = run_ranks(run_in_turn, world_size=4, each=_run_layout, cases={...})[rank]
    """
    from megatron.core import parallel_state as ps

    out = {}
    for name, kwargs in cases.items():
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        _destroy_subgroups()
        out[name] = each(**kwargs)
    return out


def _shut_groups_on_destroy() -> None:
    """Make megatron-core's ``destroy_model_parallel`` also shut its groups down in this rank
    (:func:`_destroy_subgroups`): tests that run several layouts in one world call it between
    layouts, and the engine never initializes twice in a process."""
    from megatron.core import parallel_state as ps

    original = ps.destroy_model_parallel

    def destroy_model_parallel(*args, **kwargs):
        original(*args, **kwargs)
        _destroy_subgroups()

    ps.destroy_model_parallel = destroy_model_parallel


def _destroy_subgroups() -> None:
    """Shut down every process group but the default one. megatron-core's
    ``destroy_model_parallel`` only drops its references: each gloo group keeps its threads
    (two per peer), and a world that runs many layouts in turn grew past 1500 threads a rank."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    if not dist.is_initialized():
        return
    for group in list(_world.pg_map):
        if group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)


def _call(fn: Callable[..., Any], **kwargs) -> Any:
    return fn(**kwargs)


def run_cases(
    world_size: int, cases: dict[str, tuple[Callable[..., Any], dict]], timeout: float = 600.0
) -> dict[str, list[Any]]:
    """Run ``fn(**kwargs)`` for every ``name: (fn, kwargs)`` of ``cases``, in order, in one
    world of ``world_size`` ranks (:func:`run_in_turn`); returns ``{name: results by rank}``.

    Raises:
        RuntimeError: as :func:`run_ranks` (the first failing case ends the world).
    """
    per_rank = run_ranks(
        run_in_turn,
        world_size=world_size,
        timeout=timeout,
        each=_call,
        cases={name: {"fn": fn, **kwargs} for name, (fn, kwargs) in cases.items()},
    )
    return {name: [r[name] for r in per_rank] for name in cases}
