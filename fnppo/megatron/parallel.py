"""Process groups: one ``init_parallel`` for CPU (gloo) and GPU (NCCL), and read-only helpers.

Megatron keeps its parallel state in module globals; fnppo reads it in one place,
:func:`current_layout`, and passes the :class:`ParallelLayout` (sizes, ranks and groups) explicitly
to everything below it. Functions that take a ``layout`` keyword default to reading it once there.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from fnppo.core.errors import InputError, check_int, check_number, check_positive_int, input_error
from fnppo.megatron.runtime import enter_cpu_mode_for_process, exit_cpu_mode_for_process

__all__ = ["ParallelLayout", "init_parallel", "current_layout", "destroy_parallel", "is_rank_zero", "agree_on_refusal"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class ParallelLayout:
    """A snapshot of the parallel layout of this process (sizes, ranks and groups).

    Mixture-of-Experts layers have their own grid (Megatron's expert grid): ``ep`` expert-parallel
    ranks each hold ``num_experts / ep`` experts, ``etp`` is the tensor-parallel size inside an
    expert, and ``edp = world / (etp * ep * pp)`` is the expert-data-parallel size (the ranks whose
    expert gradients are summed). Dense layers keep ``tp`` x ``pp`` x ``dp``; the ``ep`` ranks of
    one expert group are data-parallel ranks of the dense layers.
    """

    world_size: int
    rank: int
    tp: int
    pp: int
    dp: int
    vpp: int | None
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: Any
    pp_group: Any
    dp_group: Any
    backend: str
    ep: int = 1
    etp: int = 1
    ep_rank: int = 0
    etp_rank: int = 0
    edp: int = 1
    edp_rank: int = 0
    ep_group: Any = None
    etp_group: Any = None
    edp_group: Any = None
    cp: int = 1
    cp_rank: int = 0
    cp_group: Any = None
    dp_cp_group: Any = None  # data parallel x context parallel: where gradients are reduced
    mp_group: Any = None  # tensor x pipeline parallel (Megatron's model-parallel group): dense grad norms
    etmp_group: Any = None  # expert-tensor x expert x pipeline parallel: expert grad norms

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def holds_stage_ends(self, vp_stage: int | None = None) -> tuple[bool, bool]:
        """Whether this rank's chunk ``vp_stage`` (None without a virtual pipeline) is the first and the
        last stage of the model (Megatron's ``is_pipeline_first_stage`` / ``is_pipeline_last_stage``
        with ``ignore_virtual=False``)."""
        first_vp = self.vpp is None or vp_stage == 0
        last_vp = self.vpp is None or vp_stage == self.vpp - 1
        return first_vp and self.is_first_stage, last_vp and self.is_last_stage


def _default_backend(device: str | None) -> str:
    if device == "cpu":
        return "gloo"
    if device == "cuda":
        return "nccl"
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_parallel(
    tp: int = 1,
    pp: int = 1,
    *,
    vpp: int | None = None,
    ep: int = 1,
    etp: int | None = None,
    seed: int = 1234,
    device: str | None = None,
    timeout_s: float = 300.0,
    cp: int = 1,
) -> ParallelLayout:
    """Set up torch.distributed and Megatron's model-parallel groups; seed Megatron's RNG trackers.

    Works the same on CPU (gloo) and GPU (NCCL). When ``torch.distributed`` is not initialized yet,
    it is initialized from the usual environment variables (``torchrun`` sets them); with none set,
    a single process group of size 1 is created on a free local port. ``timeout_s`` bounds every
    collective: a rank that fails makes the others fail after at most that long instead of hanging.
    ``cp`` is the context-parallel size (Megatron's ``context_parallel_size``; see
    :mod:`fnppo.core.batching.context_parallel`): the world is ``tp * cp * pp * dp``.

    On the gloo backend (``device="cpu"``, or no CUDA device) it enters
    :func:`fnppo.megatron.runtime.megatron_on_cpu` for the process (until :func:`destroy_parallel`), which
    redirects Megatron's CUDA-only calls to the CPU; an explicit ``with megatron_on_cpu():`` block
    around it works too.

    ``ep`` / ``etp``: expert-parallel and expert-tensor-parallel sizes for MoE layers (Megatron's
    ``expert_model_parallel_size`` / ``expert_tensor_parallel_size``; ``etp`` defaults to ``tp``).

    Raises:
        InputError (a ``ValueError``): ``tp``/``pp``/``vpp``/``ep``/``etp``/``timeout_s``/``seed`` out of
            range or not a number (a bool, a string), ``device="cuda"`` without a CUDA device, or a
            world size that ``tp * pp`` or ``etp * ep * pp`` does not divide.
    """
    fn = "init_parallel"
    etp_size = tp if etp is None else etp
    for name, value in (("tp", tp), ("pp", pp), ("ep", ep), ("etp", etp_size), ("cp", cp)):
        check_positive_int(fn, name, value)
    check_number(fn, "timeout_s", timeout_s, low=0, low_open=True, also=" (seconds)")
    check_int(fn, "seed", seed, low=0)
    if vpp is not None and (isinstance(vpp, bool) or not isinstance(vpp, int) or vpp < 1 or pp < 2):
        raise input_error(fn, "vpp", "None or >= 1 with pp >= 2", f"vpp={vpp}, pp={pp}")
    if device not in (None, "cpu", "cuda"):
        raise input_error(fn, "device", "None, 'cpu' or 'cuda'", repr(device))
    if device == "cuda" and not torch.cuda.is_available():
        raise input_error(fn, "device", "'cpu' or None on this machine (torch.cuda.is_available() is False)", "'cuda'")
    backend = _default_backend(device)
    if backend == "gloo":
        enter_cpu_mode_for_process()
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    if world % (tp * pp * cp) != 0:  # the message keeps the cp-free wording when cp == 1
        raise InputError(
            f"init_parallel: world size {world} expected a multiple of tp*pp = {tp}*{pp}"
            + (f" times cp = {cp}" if cp > 1 else "")
            + f", received {world}"
        )
    if world % (etp_size * ep * pp) != 0:
        raise InputError(
            f"init_parallel: world size expected a multiple of etp*ep*pp = {etp_size}*{ep}*{pp}, received {world}"
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp_size,
        context_parallel_size=cp,
        distributed_timeout_minutes=timeout_s / 60.0,  # a float: Megatron's groups get timeout_s exactly
        create_gloo_process_groups=True,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return current_layout()


def current_layout() -> ParallelLayout:
    """Read Megatron's parallel state (the one place fnppo does so)."""
    return ParallelLayout(
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(),
        dp=parallel_state.get_data_parallel_world_size(),
        vpp=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        pp_group=parallel_state.get_pipeline_model_parallel_group(),
        dp_group=parallel_state.get_data_parallel_group(),
        backend=dist.get_backend(),
        ep=parallel_state.get_expert_model_parallel_world_size(),
        etp=parallel_state.get_expert_tensor_parallel_world_size(),
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        etp_rank=parallel_state.get_expert_tensor_parallel_rank(),
        edp=parallel_state.get_expert_data_parallel_world_size(),
        edp_rank=parallel_state.get_expert_data_parallel_rank(),
        ep_group=parallel_state.get_expert_model_parallel_group(),
        etp_group=parallel_state.get_expert_tensor_parallel_group(),
        edp_group=parallel_state.get_expert_data_parallel_group(),
        cp=parallel_state.get_context_parallel_world_size(),
        cp_rank=parallel_state.get_context_parallel_rank(),
        cp_group=parallel_state.get_context_parallel_group(),
        dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
        mp_group=parallel_state.get_model_parallel_group(),
        etmp_group=parallel_state.get_expert_tensor_model_pipeline_parallel_group(),
    )


def destroy_parallel() -> None:
    """Tear down Megatron's groups and the default process group (and the CPU mode init_parallel entered)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    exit_cpu_mode_for_process()


def is_rank_zero() -> bool:
    """True on global rank 0, or when torch.distributed is not initialized (logging goes here only)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def free_port() -> int:
    """A TCP port that is free on this machine right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _collective_device() -> torch.device:
    """Where the default group's collectives take their tensors: the current CUDA device under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_on_refusal(check: Callable[[], _T], layout: ParallelLayout | None = None) -> _T:
    """Run ``check`` (an entry point's input checks, which run no collective) and agree on its
    verdict over every rank of the world, so that a refusal is raised on all ranks or on none.

    Each rank catches its own :class:`~fnppo.core.errors.InputError`; one all-reduce (MAX) of a 0/1
    verdict over the whole world (every DP, TP, PP, CP and EP rank) decides. When some rank refused,
    the refusing ranks' messages are gathered (only then) and every rank raises an InputError with
    the message of the lowest refusing rank; unless every rank refused with that same message, it is
    followed by which ranks refused, e.g. ``(refused on rank 1 of 2: data-parallel rank 1)``. A rank
    that refused alone would otherwise leave the others waiting in the step's first collective.
    Without ``torch.distributed`` (or with one rank) it is ``check()`` itself: no collective.

    Args:
        check: the checks; its result is returned when no rank refused.
        layout: the parallel layout, for the ranks' coordinates in the message (default:
            :func:`current_layout` when a refusal is reported).

    Returns:
        ``check()``'s result.

    Raises:
        InputError: on every rank, when ``check`` raised one on any rank.
    """
    refusal: InputError | None = None
    result: Any = None
    try:
        result = check()
    except InputError as err:
        refusal = err
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        if refusal is not None:
            raise refusal
        return result
    verdict = torch.tensor([0 if refusal is None else 1], dtype=torch.int32, device=_collective_device())
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
    if int(verdict.item()) == 0:
        return result
    lay = layout or current_layout()
    mine = None if refusal is None else (str(refusal), lay.dp_rank, lay.pp_rank)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    refused = [(rank, r) for rank, r in enumerate(every) if r is not None]
    if refusal is not None and len(refused) == len(every) and len({r[0] for _, r in refused}) == 1:
        raise refusal  # one refusal, everywhere alike: this rank's own error is that error
    ranks = ", ".join(str(rank) for rank, _ in refused)
    dp = ", ".join(str(d) for d in sorted({r[1] for _, r in refused}))
    where = f"data-parallel rank{'s' if ',' in dp else ''} {dp}"
    if lay.pp > 1:
        pp = ", ".join(str(p) for p in sorted({r[2] for _, r in refused}))
        where += f", pipeline stage{'s' if ',' in pp else ''} {pp}"
    suffix = f" (refused on rank{'s' if len(refused) > 1 else ''} {ranks} of {dist.get_world_size()}: {where})"
    raise InputError(refused[0][1][0] + suffix) from refusal
