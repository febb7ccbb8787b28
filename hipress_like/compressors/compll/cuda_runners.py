"""cupy runners for the generated CUDA of state-array and round programs.

Three runners, one per shape of program ``render_cuda`` renders:

- ``CudaProgram`` (onebit, TBQ, TernGrad; the fused sweeps): a fixed
  schedule of kernels over the gradient, ``name:1`` on one warp and
  ``name:n`` on a grid of 256-thread blocks, the payload's size known ahead.

- ``SeqCudaProgram`` (DGC, GradDrop; ``render_cuda_seq``): the statement
  kernels in schedule order on one stream (``name:1`` on one warp,
  ``name:n`` on any grid of 256-thread blocks), the state arrays passed as a
  device array of pointers, local arrays and selection keys in one scratch
  buffer (region ``j`` at ``j * (n + 1) * 8`` bytes). The payload's size
  depends on the data, so after encode one small kernel copies the header
  fields, the arrays' byte counts and the error out of the context, and the
  host reads them: the one device-to-host wait of an encode.
- ``RoundsCudaProgram`` (PowerSGD; ``render_cuda_rounds``): each entry point
  one block-cooperative kernel. Its matrices come from device ``malloc``,
  which the runtime's copies cannot read, so added kernels copy each output
  and new state matrix (honouring its strides) into a torch tensor and free
  the block's allocations. The device heap is raised before the first
  launch (``cudaLimitMallocHeapSize``), since the default 8 MB holds no
  matrix of a large gradient.

Both run on torch CUDA tensors through ``cupy.asarray`` (no copies) on the
current stream, and give the same bits as the generated C: the kernels keep
each element's order of operations (``render_cuda_seq``, ``render_cuda_rounds``).
Errors raise as the C runners raise (``render_seq._raise`` and the round
runner's messages). A runner serialises its calls with a lock: the context
is one device buffer per program.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Tuple

import torch

from .checker import Checked
from .interp import layout
from .syntax import find_node

__all__ = ["CudaProgram", "SeqCudaProgram", "RoundsCudaProgram", "cupy_module",
           "runner_source"]

_OPTIONS = ("-std=c++17", "--fmad=false")


def cupy_module(cupy: Any, source: str, first: str) -> Any:
    """``cupy.RawModule`` of ``source``, compiled now: NVRTC first, nvcc where NVRTC
    rejects the source and nvcc exists (the failure shows here, not at a launch)."""
    try:
        mod = cupy.RawModule(code=source, options=_OPTIONS)
        mod.get_function(first)
    except Exception:
        mod = cupy.RawModule(code=source, options=_OPTIONS, backend="nvcc")
        mod.get_function(first)
    return mod


def _params(cp: Any, c: Checked, params: Dict[str, Any]) -> Any:
    return cp.asarray([float(params[pn]) for pn, _, _, _ in c.params] or [0.0],
                      dtype=cp.float64)


_SEQ_RESULT = r"""
extern "C" __global__ void cl_result_(const ctx_t* c, unsigned char* extra, long long* lens,
                                      int* err) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const unsigned char* e = (const unsigned char*)c->extra_out;
    for (int i = 0; i < (int)sizeof(c->extra_out); ++i) extra[i] = e[i];
    for (int j = 0; j < (int)(sizeof(c->out_len) / sizeof(long long)); ++j)
        lens[j] = c->out_len[j];
    *err = c->err;
}
"""


def runner_source(c: Checked) -> Dict[str, Any]:
    """What a runner compiles: ``render_cuda``'s result with the runner's own kernels
    (``cl_result_`` for state-array programs; ``cl_copy_out_`` and ``cl_free_arena_``
    for round programs) appended to its source, and their names under ``"helpers"``.

    Raises:
        CompllError: a construct the CUDA target does not compile (located).
    """
    from .render_cuda import render_cuda
    r = dict(render_cuda(c))
    if c.rounds:
        r["source"] += _ROUNDS_HELPERS
        r["helpers"] = ["cl_copy_out_", "cl_free_arena_"]
    else:
        r["source"] += _SEQ_RESULT
        r["helpers"] = ["cl_result_"]
    return r


class _Scheduled:
    """A schedule of kernels (``"name:1"`` one warp, ``"name:n"`` a grid over the
    gradient) compiled once and launched in order on the current stream; the context
    (its first 4 bytes the error code) is one device buffer per program."""

    def __init__(self, c: Checked, r: Dict[str, Any], threads: int) -> None:
        import cupy
        self.cp, self.c, self.threads, self.r = cupy, c, threads, r
        self.source = r["source"]
        self.sched = {k: [(s.split(":")[0], s.endswith(":1")) for s in r[k]]
                      for k in ("encode", "decode")}
        self.mod = cupy_module(cupy, self.source, self.sched["encode"][0][0])
        self.ctx = cupy.zeros(1 << 16, dtype=cupy.uint8)

    def _grid(self, n: int) -> int:
        return max(1, min((n + self.threads - 1) // self.threads, 4096))

    def _launch(self, which: str, args: tuple, n: int) -> None:
        for name, single in self.sched[which]:
            k = self.mod.get_function(name)
            if single:
                k((1,), (32,), args)
            else:
                k((self._grid(n),), (self.threads,), args)

    def error(self) -> int:
        """The context's error code after the last run (0: none)."""
        return int(self.ctx[:4].view(self.cp.int32)[0])


class CudaProgram(_Scheduled):
    """A fused-sweep program's CUDA kernels (``render_cuda``) run through cupy.

    Args:
        c: the checked program.
        threads: threads per block of the grid kernels.
    """

    def __init__(self, c: Checked, threads: int = 256) -> None:
        from .render_cuda import render_cuda
        super().__init__(c, render_cuda(c), threads)

    def encode(self, g: Any, extra: Any, body: Any, params: Dict[str, Any], seed: int) -> None:
        """Encode flat float32 CUDA tensor ``g`` into ``extra``/``body`` (uint8 CUDA views)."""
        cp = self.cp
        n = g.numel()
        self._launch("encode", (self.ctx, cp.asarray(g), cp.int64(n),
                                _params(cp, self.c, params), cp.asarray(extra),
                                cp.asarray(body), cp.uint32(seed & 0xFFFFFFFF)), n)

    def decode(self, extra: Any, body: Any, out: Any, params: Dict[str, Any]) -> None:
        """Decode into flat float32 CUDA tensor ``out`` (``extra``, ``body``: uint8 CUDA)."""
        cp = self.cp
        n = out.numel()
        self._launch("decode", (self.ctx, cp.asarray(extra), cp.int64(extra.numel()),
                                cp.asarray(body), cp.int64(body.numel()), cp.asarray(out),
                                cp.int64(n), _params(cp, self.c, params)), n)


class SeqCudaProgram(_Scheduled):
    """A state-array program's CUDA kernels (``render_cuda_seq``) run through cupy.

    Args:
        c: the checked program (``checker.is_sparse``).
        threads: threads per block of the grid kernels (the chunked compaction
            assumes 256, ``CL_CHUNK``).
    """

    def __init__(self, c: Checked, threads: int = 256) -> None:
        super().__init__(c, runner_source(c), threads)
        self.names = [n for n, t in c.globals.items() if t.array]
        node = _concat(c)
        self.lay = layout(node.args[1]) if node is not None else None
        self._lock = threading.Lock()

    def _scratch(self, n: int, dev: torch.device) -> torch.Tensor:
        return torch.zeros(self.r["scratch_regions"] * (n + 1) * 8, dtype=torch.uint8,
                           device=dev)

    def encode_arrays(self, g: torch.Tensor, state: Dict[str, torch.Tensor],
                      params: Dict[str, Any], raw_seed: int, step: int, seed: int = 0
                      ) -> Tuple[bytes, torch.Tensor]:
        """Run encode on flat float32 CUDA ``g`` with the flat float32 CUDA state arrays
        (updated in place), as ``render_seq``'s ``encode_arrays`` does on the CPU.

        Returns:
            (the header extra bytes, the body as a uint8 CUDA tensor).

        Raises:
            ValueError: NaN/Inf in ``g`` (the standard message; the state is not
                touched), or a threshold ratio outside (0, 1].
        """
        from .arrays import assemble_body
        from .render_seq import _raise
        cp = self.cp
        n = g.numel()
        with self._lock:
            scratch = self._scratch(n, g.device)
            st = cp.asarray([state[k].data_ptr() for k in self.names] or [0], dtype=cp.uint64)
            self._launch("encode", (self.ctx, cp.asarray(g), cp.int64(n),
                                    _params(cp, self.c, params), st,
                                    cp.uint32(seed & 0xFFFFFFFF),
                                    cp.uint32(raw_seed & 0xFFFFFFFF), cp.int64(step),
                                    cp.asarray(scratch)), n)
            nx = max(1, (self.lay.extra_nbytes + 7) // 8 * 8)
            extra = cp.zeros(nx, dtype=cp.uint8)
            lens = cp.zeros(max(1, len(self.lay.arrays)), dtype=cp.int64)
            err = cp.zeros(1, dtype=cp.int32)
            self.mod.get_function("cl_result_")((1,), (32,), (self.ctx, extra, lens, err))
            rc, lens_h = int(err.get()[0]), [int(x) for x in lens.get()]
            _raise(rc, self.c, g)
            parts = []
            for j, (a, _t) in enumerate(self.lay.arrays):
                off = self.r["encode_regions"][a.args[0]] * (n + 1) * 8
                parts.append(scratch[off:off + lens_h[j]])
            return bytes(extra.get()[:self.lay.extra_nbytes]), assemble_body(parts)

    def decode(self, extra: torch.Tensor, body: torch.Tensor, out: torch.Tensor,
               params: Dict[str, Any]) -> None:
        """Decode into flat float32 CUDA ``out`` (``extra``, ``body``: uint8 CUDA tensors).

        Raises:
            ValueError: a short or inconsistent payload, or bad indices.
        """
        from .render_seq import _raise
        cp = self.cp
        n = out.numel()
        extra = extra.contiguous() if extra.numel() else torch.zeros(1, dtype=torch.uint8,
                                                                     device=out.device)
        body = body.contiguous() if body.numel() else torch.zeros(8, dtype=torch.uint8,
                                                                  device=out.device)
        with self._lock:
            scratch = self._scratch(n, out.device)
            self._launch("decode", (self.ctx, cp.asarray(extra), cp.int64(extra.numel()),
                                    cp.asarray(body), cp.int64(body.numel()),
                                    cp.asarray(out), cp.int64(n),
                                    _params(cp, self.c, params), cp.asarray(scratch)), n)
            _raise(self.error(), self.c, None)


def _concat(c: Checked) -> Any:
    """encode's ``concat(...)`` call (None without one)."""
    return find_node(c.encode.body, lambda x: x.kind == "call" and x.args[0] == "concat")


_ROUNDS_HELPERS = r"""
extern "C" __global__ void cl_copy_out_(const cl_mat* m, int j, float* dst) {
    const cl_mat a = m[j];
    const int64_t n = a.r * a.c;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = CL_AT(a, i / a.c, i % a.c);
}
extern "C" __global__ void cl_free_arena_(void** arena, const int64_t* n_arena) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    for (int64_t i = 0; i < *n_arena; ++i) free(arena[i]);
}
"""

_heap_lock = threading.Lock()
_heap_set: List[int] = []


def _raise_heap(cp: Any, nbytes: int) -> None:
    """Raise the device ``malloc`` heap to ``nbytes`` once per process, before the first
    kernel that allocates (the limit cannot change after)."""
    with _heap_lock:
        if _heap_set:
            return
        rt = cp.cuda.runtime
        lim = getattr(rt, "cudaLimitMallocHeapSize", 2)
        rt.deviceSetLimit(lim, int(nbytes))
        _heap_set.append(int(rt.deviceGetLimit(lim)))


class RoundsCudaProgram:
    """A round program's CUDA kernels (``render_cuda_rounds``) run through cupy.

    ``run`` has the signature and results of ``render_rounds.RoundsNativeProgram.run``
    on CUDA tensors.

    Args:
        c: the checked round program.
        threads: threads of the one block each entry point runs on.
        heap_nbytes: the device ``malloc`` heap to ask for (module docstring).
    """

    def __init__(self, c: Checked, threads: int = 256, heap_nbytes: int = 4 << 30) -> None:
        import cupy
        self.cp, self.c, self.threads = cupy, c, threads
        r = runner_source(c)
        self.source = r["source"]
        _raise_heap(cupy, heap_nbytes)
        self.mod = cupy_module(cupy, self.source, r["encode"][0].split(":")[0])
        self.names = [n for n, t in c.globals.items() if t.array]
        self._lock = threading.Lock()

    def _mats(self, mats: Dict[str, torch.Tensor], dev: torch.device
              ) -> Tuple[Any, List[Tuple[int, int]]]:
        """The state as a device array of ``cl_mat`` (pointer, rows, cols, strides)."""
        rows, ptrs = [], []
        for n in self.names:
            t = mats[n]
            t2 = t if t.dim() == 2 else t.reshape(-1, 1)  # a gradient-length array: n x 1
            p = t2.data_ptr() if t2.numel() else 0
            rows.append([p, t2.shape[0], t2.shape[1], t2.shape[1], 1])
            ptrs.append((p, t2.numel()))
        arr = torch.tensor(rows or [[0, 0, 0, 0, 1]], dtype=torch.int64, device=dev)
        return arr, ptrs

    def _copy_out(self, structs: Any, host: List[List[int]], j: int,
                  dev: torch.device) -> torch.Tensor:
        d, r, c = host[j][0], host[j][1], host[j][2]
        out = torch.zeros(r, c, dtype=torch.float32, device=dev)
        if r * c and d:
            grid = max(1, min((r * c + 255) // 256, 4096))
            self.mod.get_function("cl_copy_out_")((grid,), (256,),
                                                  (self.cp.asarray(structs), self.cp.int32(j),
                                                   self.cp.asarray(out)))
        return out

    def run(self, rnd: Optional[int], g: torch.Tensor, shape: Tuple[int, ...],
            aggregate: Optional[Tuple[bytes, torch.Tensor]], mats: Dict[str, torch.Tensor],
            params: Dict[str, Any], seed: int, step: int, world_size: int
            ) -> Tuple[Any, Dict[str, torch.Tensor]]:
        """Run round ``rnd`` (None: decode) on flat float32 CUDA ``g``; the state matrices
        ``mats`` (contiguous float32 CUDA) are read, never written.

        Returns:
            ((extra bytes, body arrays) or the flat gradient, the new state matrices).

        Raises:
            ValueError: a short payload, out of device heap, or matrices of mismatched
                shapes.
        """
        from .matrices import matrix_shape
        from .render_rounds import arena_size, entry_symbol, raise_round_error
        cp, dev = self.cp, g.device
        f = self.c.decode if rnd is None else self.c.rounds[rnd]
        rows, cols = matrix_shape(shape)
        node = None if rnd is None else find_node(f.body, lambda x: x.kind == "call"
                                                  and x.args[0] == "concat")
        lay = layout(node.args[1]) if node is not None else None
        n_out = len(lay.arrays) if lay is not None else 1
        ex_in, body_in = aggregate if aggregate is not None else (b"", None)
        ex_in_d = torch.tensor(list(bytes(ex_in)) or [0], dtype=torch.uint8, device=dev)
        body_in = (body_in.to(dev).contiguous() if body_in is not None and body_in.numel()
                   else torch.zeros(8, dtype=torch.uint8, device=dev))
        blen = aggregate[1].numel() if aggregate is not None else 0
        n = g.numel()
        g = g.contiguous() if n else torch.zeros(1, device=dev)
        with self._lock:
            st, ptrs = self._mats(mats, dev)
            outs = torch.zeros(max(n_out, 1), 5, dtype=torch.int64, device=dev)
            extra = torch.zeros(max(lay.extra_nbytes if lay else 0, 1), dtype=torch.uint8,
                                device=dev)
            cap = arena_size(self.c, f)
            arena = torch.zeros(cap, dtype=torch.int64, device=dev)
            n_arena = torch.zeros(1, dtype=torch.int64, device=dev)
            err = torch.zeros(1, dtype=torch.int32, device=dev)
            a = cp.asarray
            try:
                self.mod.get_function(entry_symbol(f))(
                    (1,), (self.threads,),
                    (a(g), cp.int64(n),
                     cp.int64(rows), cp.int64(cols), _params(cp, self.c, params),
                     cp.uint32(seed & 0xFFFFFFFF), cp.int64(step), cp.int64(world_size),
                     a(ex_in_d), cp.int64(len(ex_in)), a(body_in), cp.int64(blen), a(st),
                     a(extra), a(outs), a(arena), a(n_arena), a(err)))
                raise_round_error(int(err.item()), self.c, f)  # 5: the device malloc heap
                st_h, outs_h = st.tolist(), outs.tolist()
                new = {}
                for j, name in enumerate(self.names):
                    if st_h[j][0] and st_h[j][0] == ptrs[j][0] and \
                            st_h[j][1] * st_h[j][2] == ptrs[j][1]:
                        new[name] = mats[name]  # not reassigned: keep it
                    else:
                        m = self._copy_out(st, st_h, j, dev)
                        new[name] = m if self.c.globals[name].matrix else m.reshape(-1)
                if rnd is None:
                    res = self._copy_out(outs, outs_h, 0, dev).reshape(-1)[:n]
                    return res, new
                parts = [self._copy_out(outs, outs_h, j, dev).reshape(-1).view(torch.uint8)
                         for j in range(n_out)]
                return (bytes(extra.cpu().tolist())[:lay.extra_nbytes], parts), new
            finally:
                self.mod.get_function("cl_free_arena_")((1,), (32,), (a(arena), a(n_arena)))
