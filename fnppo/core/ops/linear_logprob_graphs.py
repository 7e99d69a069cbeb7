"""The cache of static buffers and CUDA graphs for the backward of the fused output layer.

:class:`BackwardGraphs` runs the backward of :func:`fnppo.core.ops.linear_logprob.linear_logprob_and_entropy`
from static buffers and, on CUDA, replays it as a CUDA graph: one launch instead of three per
vocabulary block, for steps whose host time binds. The blocks themselves (the backward's body and
its block sizes) are :mod:`fnppo.core.ops.linear_logprob`'s, passed in by its autograd function; this
module only manages buffers, graphs and streams.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from fnppo.core.errors import check_positive_int
from fnppo.core.typing import Tensor

__all__ = ["BackwardGraphs"]


class _Workspace:
    """Static buffers of one weight (see :class:`BackwardGraphs`); rows beyond ``dirty`` are zero."""

    __slots__ = ("rows", "h", "labels", "tok", "dh", "dw", "dz", "acc", "graphs", "seen", "failed", "dirty", "stream")

    def tensors(self) -> list[Tensor]:
        return [t for t in (self.h, self.labels, self.tok, self.dh, self.dw, self.dz, self.acc) if t is not None]


class BackwardGraphs:
    r"""Static buffers and CUDA graphs for the backward of :func:`linear_logprob_and_entropy`.

    The fused backward launches three kernels per block of vocabulary rows (the block of logit
    gradients, then its two products ``dh += dz @ w_block`` and ``dw_block = dz.T @ h``): 96 launches
    for 8,192 tokens x 151,936 columns at hidden 896, about 5 ms of host time per call on an H200
    host. Where the host binds the step (small models), that time is added to it. Passed as
    ``graphs=`` (or ``StepFns.fused(graphs=...)``), this cache makes the backward

    1. copy its per-call inputs (hidden states, labels, the upstream gradients, the entropy and the
       log-sum-exp) into static buffers of ``rows = ceil(tokens / row_multiple) * row_multiple``
       rows. Rows past ``tokens`` are zero: hidden 0 and coefficients 0 give logit gradients of
       exactly 0 (``dz = p (c - b log p) + a 1[j = label]`` with ``a = b = c = 0`` and finite
       ``p``), so they add nothing to the weight gradient;
    2. run the blocks from those buffers: on CUDA with the Triton implementation, eagerly the first
       time a key ``(rows, which gradients, temperature, shard)`` is seen (this also compiles and
       autotunes the kernels), then captured once as a CUDA graph (``torch.cuda.CUDAGraph``) and
       replayed from the second time on, one launch for all blocks; elsewhere always eagerly;
    3. return copies of the gradients (the buffers are overwritten by the next call).

    Values equal those of a call without the cache (the same kernels; the padding rows add exact
    zeros). The weight is read in place by its address: a weight at a new address (or of another
    shape, dtype or device) gets buffers of its own, the least recently used beyond
    ``max_weights`` are dropped; at most ``max_graphs`` graphs per weight are kept (least recently
    used dropped). Updates of the weight between calls (optimizer steps) are seen by the replays.
    A token count above the buffers' rows reallocates them (and drops that weight's graphs).

    Memory, held until :meth:`clear` (or until the cache is dropped): per weight a weight-sized
    gradient buffer, the padded hidden states and their gradient, one block of logit gradients and
    the fp32 hidden-gradient accumulator. For 8,192 tokens, hidden 896 and 151,936 bf16 columns:
    0.25 + 2 x 0.014 + 0.074 + 0.027 = 0.38 GiB, about 0.17 of one bf16 logits tensor
    (:meth:`nbytes`), beside the 0.045 of the backward itself. Measured on an H200 at that shape
    (BENCHMARKS.md): the host time of a fused forward + backward falls from 4.4 to 1.5 ms, the GPU
    time stays (16.15 against 16.14 ms).

    Reference: CUDA graphs, NVIDIA CUDA C++ Programming Guide, "CUDA Graphs"; PyTorch
    ``torch.cuda.CUDAGraph``.

    Args:
      row_multiple: the buffers' token rows are rounded up to a multiple of it (fewer distinct
        graphs for varying micro-batch sizes, at most ``row_multiple - 1`` padding rows of work).
      max_graphs: graphs kept per weight.
      max_weights: weights (buffer sets) kept.

    Attributes:
      captures, replays, eager_calls: counts of backward calls by how they ran.

    Raises:
      InputError: a size that is not an int >= 1.
    """

    def __init__(self, *, row_multiple: int = 256, max_graphs: int = 32, max_weights: int = 2) -> None:
        for name, value in (("row_multiple", row_multiple), ("max_graphs", max_graphs), ("max_weights", max_weights)):
            check_positive_int("fnppo.ops.BackwardGraphs", name, value)
        self.row_multiple, self.max_graphs, self.max_weights = int(row_multiple), int(max_graphs), int(max_weights)
        self._spaces: OrderedDict[tuple, _Workspace] = OrderedDict()
        self.captures = self.replays = self.eager_calls = 0

    def clear(self) -> None:
        """Drop every buffer and graph (their memory returns to PyTorch's allocator)."""
        self._spaces.clear()

    def nbytes(self) -> int:
        """Bytes of the static buffers held now (the graphs' own few-kB pools not counted)."""
        return sum(t.numel() * t.element_size() for ws in self._spaces.values() for t in ws.tensors())

    def __repr__(self) -> str:
        return (
            f"BackwardGraphs(row_multiple={self.row_multiple}, weights={len(self._spaces)}, "
            f"graphs={sum(len(ws.graphs) for ws in self._spaces.values())}, captures={self.captures}, "
            f"replays={self.replays}, eager_calls={self.eager_calls}, nbytes={self.nbytes()})"
        )

    # -- the backward --------------------------------------------------------------------------
    def _backward(
        self,
        h2: Tensor,
        weight: Tensor,
        labels: Tensor,
        per_token: tuple[Tensor | None, ...],
        cfg: Any,
        need_h: bool,
        need_w: bool,
        *,
        grads: Callable[..., Tensor | None],
        chunks: Callable[..., dict[str, int]],
    ) -> tuple[Tensor | None, Tensor | None] | None:
        """``(dh, dw)`` through the static buffers, or None (no tokens: the caller's eager path).

        ``cfg`` holds the call's non-tensor arguments, ``grads`` and ``chunks`` are the backward's
        body and its block sizes (``_grads`` and ``_backward_chunks`` of :mod:`fnppo.core.ops.linear_logprob`),
        run here on the buffers as on a call of ``rows`` tokens.
        """
        n, hid = h2.shape
        if n == 0:
            return None
        rows = -(-n // self.row_multiple) * self.row_multiple
        wkey = (
            str(weight.device),
            weight.dtype,
            weight.data_ptr(),
            tuple(weight.shape),
            tuple(weight.stride()),
            cfg.n_valid,
            cfg.impl,
            cfg.chunk_tokens,
            cfg.chunk_vocab,
        )
        ws = self._spaces.pop(wkey, None)
        if ws is None or ws.rows < rows:
            ws = None  # free the old buffers first
            ws = self._workspace(weight, hid, rows, cfg)
        self._spaces[wkey] = ws
        while len(self._spaces) > self.max_weights:
            self._spaces.popitem(last=False)
        self._copy_in(ws, h2, labels, per_token)
        present = tuple(t is not None for t in per_token)
        w_valid = weight[: cfg.n_valid]
        sizes = chunks(rows, weight.shape[0], hid, weight.element_size(), cfg)  # as a call of `rows` tokens
        if cfg.impl == "triton":
            block = (min(sizes["group_tokens"], rows), min(sizes["block_vocab"], max(cfg.n_valid, 1)))
            self._block_space(ws, block, hid)
        spaces = {"dh_out": ws.dh[:rows]}
        if cfg.impl == "triton":
            spaces.update(dz_space=ws.dz, acc_space=ws.acc)

        def body() -> None:
            pt = tuple(ws.tok[i, :rows] if p else None for i, p in enumerate(present))
            dw = ws.dw[: cfg.n_valid] if need_w else None
            grads(ws.h[:rows], w_valid, ws.labels[:rows], pt, cfg, need_h, dw, sizes, spaces)

        key = (rows, present, need_h, need_w, cfg.inv_t, cfg.vocab_start)
        graph = ws.graphs.get(key)
        if graph is not None:
            ws.graphs.move_to_end(key)
            graph.replay()
            self.replays += 1
        elif ws.stream is not None and key in ws.seen and key not in ws.failed:
            graph = self._capture(ws, body)
            if graph is None:  # ran eagerly; this key is not captured again
                ws.failed.add(key)
                self.eager_calls += 1
            else:
                ws.graphs[key] = graph
                while len(ws.graphs) > self.max_graphs:
                    ws.graphs.popitem(last=False)
                graph.replay()
                self.captures += 1
        else:
            ws.seen.add(key)
            self._on_side_stream(ws, body)
            self.eager_calls += 1
        dh = ws.dh[:n].clone() if need_h else None
        dw = ws.dw.clone() if need_w else None
        return dh, dw

    def _workspace(self, weight: Tensor, hid: int, rows: int, cfg: Any) -> _Workspace:
        ws = _Workspace()
        dev = weight.device
        ws.rows, ws.dirty = rows, 0
        ws.h = torch.zeros((rows, hid), dtype=weight.dtype, device=dev)
        ws.labels = torch.zeros(rows, dtype=torch.int64, device=dev)
        ws.tok = torch.zeros((4, rows), dtype=torch.float32, device=dev)  # g_lp, g_h, entropy, lse
        ws.dh = torch.empty((rows, hid), dtype=weight.dtype, device=dev)
        ws.dw = torch.empty(weight.shape, dtype=weight.dtype, device=dev)
        ws.dw[cfg.n_valid :].zero_()  # padding rows beyond the real vocabulary
        ws.dz = ws.acc = None
        ws.graphs, ws.seen, ws.failed = OrderedDict(), set(), set()
        ws.stream = torch.cuda.Stream(device=dev) if dev.type == "cuda" and cfg.impl == "triton" else None
        return ws

    @staticmethod
    def _block_space(ws: _Workspace, shape: tuple[int, int], hid: int) -> None:
        """The block of logit gradients (and the fp32 accumulator) hold ``shape``; when they grow,
        the graphs that read the old ones are dropped, and each key runs eagerly once more."""
        if ws.dz is not None and ws.dz.shape[0] >= shape[0] and ws.dz.shape[1] >= shape[1]:
            return
        rows = max(shape[0], 0 if ws.dz is None else ws.dz.shape[0])
        cols = max(shape[1], 0 if ws.dz is None else ws.dz.shape[1])
        ws.graphs.clear()
        ws.seen.clear()
        ws.dz = ws.acc = None
        ws.dz = torch.empty((rows, cols), dtype=ws.h.dtype, device=ws.h.device)
        ws.acc = torch.empty((rows, hid), dtype=torch.float32, device=ws.h.device)

    @staticmethod
    def _copy_in(ws: _Workspace, h2: Tensor, labels: Tensor, per_token: tuple[Tensor | None, ...]) -> None:
        n = h2.shape[0]
        ws.h[:n].copy_(h2)
        ws.labels[:n].copy_(labels)
        for i, t in enumerate(per_token):
            if t is not None:
                ws.tok[i, :n].copy_(t)
        if ws.dirty > n:  # rows a larger call wrote: back to zero
            ws.h[n : ws.dirty].zero_()
            ws.labels[n : ws.dirty].zero_()
            ws.tok[:, n : ws.dirty].zero_()
        ws.dirty = n

    @staticmethod
    def _on_side_stream(ws: _Workspace, fn: Any) -> None:
        """Run ``fn`` on the buffers' own stream (where the graphs are captured), ordered after and
        before the current stream's work; off CUDA just run it."""
        if ws.stream is None:
            fn()
            return
        cur = torch.cuda.current_stream(ws.h.device)
        ws.stream.wait_stream(cur)
        with torch.cuda.stream(ws.stream):
            fn()
        cur.wait_stream(ws.stream)

    def _capture(self, ws: _Workspace, body: Any) -> Any:
        """``body`` captured as a CUDA graph on the buffers' stream; None (with a warning, and
        ``body`` run eagerly) if capturing fails here."""
        graph = torch.cuda.CUDAGraph()
        error: list[BaseException] = []

        def capture() -> None:
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                body()
            except BaseException as exc:  # noqa: BLE001 - ended below, then reported
                error.append(exc)
            finally:
                graph.capture_end()

        try:
            self._on_side_stream(ws, capture)
        except RuntimeError as exc:
            error.append(exc)
        if not error:
            return graph
        warnings.warn(
            f"fnppo.ops.BackwardGraphs: capturing the fused backward failed ({error[0]!r}); it runs without a graph",
            RuntimeWarning,
            stacklevel=3,
        )
        ws.stream.synchronize()
        self._on_side_stream(ws, body)
        return None
