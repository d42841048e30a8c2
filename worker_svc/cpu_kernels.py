"""Builds (with the system C compiler) and loads the fused bf16 decode kernels of cpu_kernels.c.

The build takes well under a second and happens once: `make setup` runs it, and a worker that
finds no up-to-date library builds it on first use (into the package directory, or into
~/.cache/llmserve when that is read-only). Without a C compiler, or with LLMSERVE_CPU_KERNELS=0,
`load()` returns None and the model runs its plain torch path.

python -m worker_svc.cpu_kernels   # build now, print where the library is
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# the files SOURCE includes: part of what names the built library
INCLUDED = tuple(
    Path(__file__).with_name(name) for name in ("amx_matmul.c", "kv_int8.c", "vnni_matmul.c")
)
FLAGS = ["-O3", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros"]
# reassociation lets the compiler vectorise the dot products' sums
FLAGS += ["-fassociative-math", "-fopenmp"]
# LLMSERVE_KERNEL_ARCH: the -march to build for; "native" (the default) suits a build on the
# machine that runs it; an image built once for many hosts should say e.g. x86-64-v3.
ARCH = os.environ.get("LLMSERVE_KERNEL_ARCH", "native")
ARCH_FLAGS = [[f"-march={ARCH}"], []]  # the second is the fallback on compilers without it

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
MAX_DIM = 256  # cpu_kernels.c's


def _library_name() -> str:
    flags = " ".join([*FLAGS, ARCH]).encode()
    text = b"".join(path.read_bytes() for path in (SOURCE, *INCLUDED))
    digest = hashlib.sha256(text + flags).hexdigest()[:12]
    return f"_cpu_kernels-{digest}.so"


def _candidates() -> list[Path]:
    name = _library_name()
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llmserve"
    return [SOURCE.with_name(name), cache / name]


def build() -> Path | None:
    """The library's path, compiling it first if no up-to-date copy exists; None if impossible."""
    for path in _candidates():
        if path.exists():
            return path
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler found: the model runs without its fused CPU kernels")
        return None
    for path in _candidates():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
            os.close(handle)
        except OSError:
            continue  # not writable: try the next place
        for arch in ARCH_FLAGS:
            done = compile_source(compiler, arch, tmp)
            if done.returncode == 0:
                os.replace(tmp, path)  # atomic: concurrent builders leave one whole file
                return path
            log.warning("building %s with %s failed: %s", SOURCE.name, arch, done.stderr[-800:])
        os.unlink(tmp)
        return None
    return None


def compile_source(compiler: str, arch: list[str], output: str) -> subprocess.CompletedProcess:
    command = [compiler, *FLAGS, *arch, "-o", output, str(SOURCE), "-lm"]
    return subprocess.run(command, capture_output=True, text=True, check=False)


class CpuKernels:
    """Thin typed wrappers; every tensor argument must be contiguous bf16 (int64 for indices)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._norm = library.add_rms_norm_bf16
        self._norm.argtypes = [_P, _P, _P, _I, _I, _F, _P]
        self._norm.restype = None
        # absent from libraries built from older sources, as silu_mul
        self._norm_f32 = getattr(library, "add_rms_norm_f32", None)
        if self._norm_f32 is not None:
            self._norm_f32.argtypes = [_P, _P, _P, _I, _I, _F, _P]
            self._norm_f32.restype = None
        self._rope = library.rope_store_bf16
        self._rope.argtypes = [_P, _P, _P, _P, _P, _I, _I, _I, _I, _P, _P, _P, _P]
        self._rope.restype = None
        self._attend = library.decode_attention_bf16
        self._attend.argtypes = [_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _P]
        self._attend.restype = ctypes.c_int
        # the int8 pool's (--kv-cache-dtype int8); absent from libraries built from older sources
        self._rope_q8 = getattr(library, "rope_store_q8", None)
        if self._rope_q8 is not None:
            self._rope_q8.argtypes = [_P, _P, _P, _P, _P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P]
            self._rope_q8.restype = None
        self._attend_q8 = getattr(library, "decode_attention_q8", None)
        if self._attend_q8 is not None:
            self._attend_q8.argtypes = [_P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _P]
            self._attend_q8.restype = ctypes.c_int
        self._gather_q8 = getattr(library, "gather_q8_bf16", None)
        if self._gather_q8 is not None:
            self._gather_q8.argtypes = [_P, _P, _P, _I, _I, _P]
            self._gather_q8.restype = None
        self._as_stored = getattr(library, "as_stored_q8_bf16", None)
        if self._as_stored is not None:
            self._as_stored.argtypes = [_P, _I, _I, _I, _I, _P]
            self._as_stored.restype = None
        # absent from libraries built from older sources (llmserve.bench.kernels_vs loads them)
        self._silu_mul = getattr(library, "silu_mul_bf16", None)
        if self._silu_mul is not None:
            self._silu_mul.argtypes = [_P, _I, _I, _P]
            self._silu_mul.restype = None
        # absent from libraries built from older sources, as silu_mul
        self._refine = getattr(library, "refine_near_max_bf16", None)
        if self._refine is not None:
            self._refine.argtypes = [_P, _I, _I, _F, _P, _P, _I]
            self._refine.restype = None
        # absent from libraries built from older sources, as silu_mul
        self._blocked = {
            kind: getattr(library, f"{kind}_matmul_bf16", None) for kind in ("int4", "int8")
        }
        built = getattr(library, "blocked_kernels_built", None)
        present = all(fn is not None for fn in self._blocked.values())
        self.blocked = present and built is not None and bool(built())
        for fn in self._blocked.values():
            if fn is not None:
                fn.argtypes = [_P, _I, _I, _P, _I, _P]
                fn.restype = ctypes.c_int
        # int4 on int8 activations (vnni_matmul.c): absent from older libraries, 0 where not built
        vnni = getattr(library, "vnni_matmul_built", None)
        a8 = getattr(library, "int4_matmul_a8", None)
        self.vnni = self.blocked and vnni is not None and a8 is not None and bool(vnni())
        if a8 is not None:
            a8.argtypes = [_P, _I, _I, _P, _I, _P]
            a8.restype = ctypes.c_int
            self._blocked["int4a8"] = a8
        self._a8_ratio = getattr(library, "set_a8_outlier_ratio", None)
        if self._a8_ratio is not None:
            self._a8_ratio.argtypes = [ctypes.c_float]
            self._a8_ratio.restype = None
        # absent from libraries built from older sources, as silu_mul; 0 where not built (no AMX
        # in -march) or the tiles are not granted to this process
        ready = getattr(library, "amx_kernels_ready", None)
        self._amx = getattr(library, "int4_matmul_amx", None)
        self.amx = self.blocked and ready is not None and self._amx is not None and bool(ready())
        if self._amx is not None:
            self._amx.argtypes = [_P, _I, _I, _P, _I, _P]
            self._amx.restype = ctypes.c_int
        self._threads = library.set_threads
        self._threads.argtypes = [ctypes.c_int]
        self._threads.restype = None

    def set_a8_outlier_ratio(self, ratio: float) -> None:
        """int4_matmul_a8's outlier rule (vnni_matmul.c): a group's largest value is kept apart
        where it exceeds `ratio` times the second largest (inf: never)."""
        if self._a8_ratio is None:
            raise NotImplementedError("this kernel library has no int4_matmul_a8")
        self._a8_ratio(ratio)

    def set_threads(self, threads: int) -> None:
        """OpenMP threads for the parallel kernels (pass torch.get_num_threads())."""
        self._threads(threads)

    def add_rms_norm(
        self,
        x: torch.Tensor,  # [rows, hidden] bf16 or fp32 (the residual), updated: x += delta
        delta: torch.Tensor | None,  # [rows, hidden] bf16
        weight: torch.Tensor,  # [hidden] bf16
        eps: float,
        out: torch.Tensor,  # [rows, hidden] bf16: rms_norm(x) * weight
    ) -> None:
        rows, hidden = x.shape
        d = delta.data_ptr() if delta is not None else None
        norm = self._norm
        if x.dtype == torch.float32:
            if self._norm_f32 is None:
                raise NotImplementedError("this kernel library has no fp32-residual norm")
            norm = self._norm_f32
        norm(x.data_ptr(), d, weight.data_ptr(), rows, hidden, eps, out.data_ptr())

    def silu_mul(
        self,
        gate_up: torch.Tensor,  # [rows, 2 * inter]: each row [gate | up]
        out: torch.Tensor,  # [rows, inter]: silu(gate) * up
    ) -> None:
        if self._silu_mul is None:
            raise NotImplementedError("this kernel library has no silu_mul")
        rows, inter = out.shape
        self._silu_mul(gate_up.data_ptr(), rows, inter, out.data_ptr())

    def refine_near_max(
        self,
        logits: torch.Tensor,  # [rows, vocab] fp32, contiguous: updated in place
        hidden: torch.Tensor,  # [rows, in] bf16
        weight: torch.Tensor,  # [vocab, in] bf16
        frac: float,
    ) -> bool:
        """near_ties.refine_near_max in one pass per row; False where this library lacks it."""
        if self._refine is None:
            return False
        rows, vocab = logits.shape
        h = hidden.contiguous()
        self._refine(logits.data_ptr(), rows, vocab, frac, h.data_ptr(), weight.data_ptr(),
                     h.shape[1])  # fmt: skip
        return True

    def blocked_matmul(
        self,
        kind: str,  # int4, int8, or int4a8 (int4 on int8 activations, where self.vnni)
        x: torch.Tensor,  # [rows, in] bf16, contiguous
        blocked: torch.Tensor,  # worker_svc.blocked_matmul's layout of the weight
        out_features: int,
    ) -> torch.Tensor:
        """[rows, out_features] bf16: x @ W.T for the quantized W laid out in `blocked`."""
        fn = self._blocked.get(kind)
        if not self.blocked or fn is None:
            raise NotImplementedError("this kernel library has no AVX-512 BF16 blocked matmul")
        rows, inputs = x.shape
        y = torch.empty(rows, out_features, dtype=torch.bfloat16)
        status = fn(x.data_ptr(), rows, inputs, blocked.data_ptr(), out_features, y.data_ptr())
        if status == -1:
            raise ValueError(f"{kind}_matmul: unsupported shape {rows}x{inputs} -> {out_features}")
        if status:
            raise MemoryError(f"{kind}_matmul: no memory for the groups' sums")
        return y

    def int4_matmul_amx(
        self,
        x: torch.Tensor,  # [rows, in] bf16, contiguous
        blocked: torch.Tensor,  # worker_svc.blocked_matmul's int4 layout of the weight
        out_features: int,
    ) -> torch.Tensor:
        """[rows, out_features] bf16 by AMX tiles, from the same layout as blocked_matmul's
        int4 (amx_matmul.c)."""
        if not self.amx:
            raise NotImplementedError("this kernel library or process has no AMX int4 matmul")
        rows, inputs = x.shape
        y = torch.empty(rows, out_features, dtype=torch.bfloat16)
        status = self._amx(x.data_ptr(), rows, inputs, blocked.data_ptr(), out_features,
                           y.data_ptr())  # fmt: skip
        if status == -1:
            raise ValueError(
                f"int4_matmul_amx: unsupported shape {rows}x{inputs} -> {out_features}"
            )
        if status:
            raise MemoryError("int4_matmul_amx: no memory for the tiles")
        return y

    def rope_store(
        self,
        qkv: torch.Tensor,  # [n, (heads + 2 * kv_heads) * dim]
        cos: torch.Tensor,  # [max_positions, dim]
        sin: torch.Tensor,  # [max_positions, dim], sign-folded
        positions: torch.Tensor,  # [n] int64
        slots: torch.Tensor,  # [n] int64
        q_out: torch.Tensor,  # [n, heads, dim]
        k_layer: int,  # data pointers of one layer's pool: [slots, kv_heads, dim]
        v_layer: int,
        kv_heads: int,
        k_out: torch.Tensor | None = None,  # [n, kv_heads, dim]: the rotated keys here too
        scales: tuple[int, int] | None = None,  # an int8 pool's K and V scales (KvPool)
    ) -> None:
        """With `scales`, the pool is int8 (k_layer, v_layer its codes): rope_store_q8."""
        n, heads, dim = q_out.shape
        head = [qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr()]
        head += [slots.data_ptr(), n, heads, kv_heads, dim, q_out.data_ptr(), k_layer, v_layer]
        k_rows = k_out.data_ptr() if k_out is not None else None
        if scales is None:
            self._rope(*head, k_rows)
        elif self._rope_q8 is None or dim > MAX_DIM:
            raise ValueError(f"rope_store: no int8 KV store for head_dim {dim} in this build")
        else:
            self._rope_q8(*head, *scales, k_rows)

    def as_stored(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [n, heads, dim] bf16 as an int8 pool holds it (kv_pool.as_stored, bit for bit), in
        one pass; None where this build lacks the kernel or x's layout does not suit it (each
        token's rows contiguous)."""
        n, heads, dim = x.shape
        if self._as_stored is None or x.dtype != torch.bfloat16 or dim > MAX_DIM:
            return None
        if x.stride(2) != 1 or x.stride(1) != dim:
            return None
        out = torch.empty(n, heads, dim, dtype=torch.bfloat16)
        self._as_stored(x.data_ptr(), n, heads, dim, x.stride(0), out.data_ptr())
        return out

    def gather_q8(
        self,
        codes: torch.Tensor,  # [rows_total, dim] int8: an int8 pool's layer, as KvPool.rows
        scales: torch.Tensor,  # [rows_total] fp32: their scales
        rows: torch.Tensor,  # [n] int64: the rows wanted
    ) -> torch.Tensor | None:
        """codes[rows] * scales[rows] as bf16 [n, dim], bit for bit torch's; None where this
        build lacks the kernel."""
        if self._gather_q8 is None:
            return None
        rows = rows.to(torch.int64).contiguous()
        n, dim = rows.shape[0], codes.shape[1]
        out = torch.empty(n, dim, dtype=torch.bfloat16)
        self._gather_q8(
            codes.data_ptr(), scales.data_ptr(), rows.data_ptr(), n, dim, out.data_ptr()
        )
        return out

    def decode_attention(
        self,
        q: torch.Tensor,  # [nd, heads, dim]
        k_layer: int,  # data pointers of one layer's pool: [blocks, block_size, kv_heads, dim]
        v_layer: int,
        tables: torch.Tensor,  # [nd, max_blocks] int64
        lengths: torch.Tensor,  # [nd] int64
        block_size: int,
        kv_heads: int,
        scale: float,
        out: torch.Tensor,  # [nd, heads, dim]
        scales: tuple[int, int] | None = None,  # an int8 pool's K and V scales (KvPool)
    ) -> None:
        """With `scales`, the pool is int8 (k_layer, v_layer its codes): decode_attention_q8."""
        nd, heads, dim = q.shape
        pools = [q.data_ptr(), k_layer, v_layer]
        rest = [tables.data_ptr(), lengths.data_ptr(), nd, tables.shape[1], block_size, heads]
        rest += [kv_heads, dim, scale, out.data_ptr()]
        if scales is None:
            status = self._attend(*pools, *rest)
        elif self._attend_q8 is None:
            raise ValueError("decode_attention: no int8 KV attention in this build")
        else:
            status = self._attend_q8(*pools, *scales, *rest)
        if status == -1:
            raise ValueError(f"decode_attention: unsupported shape {tuple(q.shape)}")
        if status:
            raise MemoryError("decode_attention: no memory for attention scores")


_loaded: CpuKernels | None = None
_tried = False


def load() -> CpuKernels | None:
    """The kernels, built on first use; None when disabled or no compiler is available."""
    global _loaded, _tried
    if os.environ.get("LLMSERVE_CPU_KERNELS", "1") == "0":
        return None
    if not _tried:
        _tried = True
        missing = missing_cpu_features(ARCH, cpu_flags())
        if missing:  # a library built elsewhere (an image) for a newer CPU would crash here
            log.warning("CPU lacks %s for -march=%s: torch path", ", ".join(missing), ARCH)
            return None
        path = build()
        if path is not None:
            _loaded = CpuKernels(ctypes.CDLL(str(path)))
    return _loaded


# What each -march level named in LLMSERVE_KERNEL_ARCH needs, as /proc/cpuinfo spells it
# ("native" is built where it runs: nothing to check).
ARCH_NEEDS = {
    "x86-64-v2": ["sse4_2", "popcnt"],
    "x86-64-v3": ["sse4_2", "popcnt", "avx2", "fma", "bmi2"],
    "x86-64-v4": ["sse4_2", "popcnt", "avx2", "fma", "bmi2", "avx512f", "avx512bw"],
}


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo; None where there is no such file."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return None


def missing_cpu_features(arch: str, flags: set[str] | None) -> list[str]:
    """Features the -march level needs that this CPU lacks (none known: nothing missing)."""
    if flags is None:
        return []
    return [f for f in ARCH_NEEDS.get(arch, []) if f not in flags]


if __name__ == "__main__":
    built = build()
    print(built if built else "not built: no C compiler (the torch path will be used)")
