"""Appendix F's CPU runtime for CUDA C (kernels/cuda_on_cpu.h, ds4ref.dev.cuda_on_cpu): the shuffle,
barrier and built-in semantics against independent numpy formulas, the errors for what CUDA leaves
undefined, the launch checks, the ucontext build, and that a planted bug in a kernel's source is caught.
The kernels themselves are checked against numpy and ds4.c by the `cuda-on-cpu` cases of
tests/test_backends.py and tests/test_cupy_resident.py."""
from __future__ import annotations

import numpy as np
import pytest

from ds4ref.backends.cupy_kernels import KERNEL_FILES, KERNEL_NAMES, kernel_dir, kernel_source
from ds4ref.checks import rel
from ds4ref.dev.cuda_on_cpu import CpuModule, CudaOnCpuError, build, compiler
from ds4ref.dev.quantize import quantize
from ds4ref.matvec import matvec_q8_0_prequant
from ds4ref.quant import quantize_q8_0

KDIR = f"-I{kernel_dir()}"

PROBES = r"""
#include "ds4_common.cuh"
// out[t] = x[lane ^ o] for one shuffle with offset o, per warp
extern "C" __global__ void shuffle_once(const int *x, int o, int *out) {
    const int t = threadIdx.x;
    out[t] = __shfl_xor_sync(0xffffffffu, x[t], o);
}
// every lane's warp_sum (float) and warp_sum_d (double) of x
extern "C" __global__ void sums(const float *x, float *s, double *sd) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    s[t] = warp_sum(x[t]);
    sd[t] = warp_sum_d((double)x[t]);
}
// block_sum and block_max over the block, written by every thread
extern "C" __global__ void block_reduce(const float *x, float *s, float *m) {
    __shared__ float red[32];
    const int t = threadIdx.x;
    const float a = block_sum(x[t], red);
    const float b = block_max(x[t], red);
    s[t] = a;
    m[t] = b;
}
// each thread writes its slot of dynamic shared memory, meets the block, reads its neighbour's
extern "C" __global__ void neighbour(float *out, int use_barrier) {
    DYNAMIC_SHARED(float, buf);
    const int t = threadIdx.x, n = blockDim.x;
    buf[t] = (float)(10 * t);
    if (use_barrier) __syncthreads();
    out[t] = buf[(t + 1) % n];
}
// coordinates: out[block, thread] = (blockIdx, threadIdx, gridDim, blockDim) packed
extern "C" __global__ void coords(int *out) {
    const int b = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    const int nt = blockDim.x * blockDim.y * blockDim.z;
    const int t = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
    int *o = out + 4 * (b * nt + t);
    o[0] = b; o[1] = t; o[2] = gridDim.x * gridDim.y * gridDim.z; o[3] = nt;
}
extern "C" __global__ void dp4a_popc(const int *a, const int *b, const int *c, int *d, int *p) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    d[t] = __dp4a(a[t], b[t], c[t]);
    p[t] = __popc((u32)a[t]);
}
extern "C" __global__ void halves(const u16 *h, float *f) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    f[t] = f16_to_f32(h[t]);
}
// undefined on a GPU: a shuffle after some lanes returned
extern "C" __global__ void early_return(float *x, int n) {
    if ((int)threadIdx.x >= n) return;
    x[threadIdx.x] = warp_sum(x[threadIdx.x]);
}
// undefined on a GPU: lanes of one warp at different shuffles
extern "C" __global__ void diverged(float *x) {
    float v = x[threadIdx.x];
    if (threadIdx.x & 1) v = __shfl_xor_sync(0xffffffffu, v, 2);
    else                 v = __shfl_xor_sync(0xffffffffu, v, 4);
    x[threadIdx.x] = v;
}
extern "C" __global__ void half_mask(float *x) {
    x[threadIdx.x] = __shfl_xor_sync(0x0000ffffu, x[threadIdx.x], 1);
}
extern "C" __global__ void barrier_after_return(float *x) {
    if (threadIdx.x >= 64) return;
    __syncthreads();
    x[threadIdx.x] = 1.0f;
}
"""


@pytest.fixture(scope="module")
def probes():
    return CpuModule(PROBES, (KDIR,))


def test_a_shuffle_reads_lane_xor_offset_in_every_warp(probes):
    k = probes.get_function("shuffle_once")
    x = np.arange(128, dtype=np.int32) * 7 + 3
    lane = np.arange(128)
    for o in range(32):
        out = np.full(128, -1, np.int32)
        k(1, 128, (x, np.int32(o), out))
        assert np.array_equal(out, x[(lane & ~31) | ((lane & 31) ^ o)]), o


def test_warp_sums_are_the_butterfly_sums(probes):
    """warp_sum adds in the butterfly's order: every lane gets the same float, equal to a numpy
    butterfly over the warp (and the exact sum in double for integers)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal(256).astype(np.float32)
    s, sd = np.zeros(256, np.float32), np.zeros(256, np.float64)
    probes.get_function("sums")(2, 128, (x, s, sd))
    v = x.reshape(-1, 32).copy()
    for o in (16, 8, 4, 2, 1):
        v = (v + v[:, np.arange(32) ^ o]).astype(np.float32)
    assert np.array_equal(s, v.reshape(-1))
    assert np.allclose(sd, np.repeat(x.reshape(-1, 32).astype(np.float64).sum(1), 32), rtol=1e-15)


def test_block_reductions_meet_at_their_barriers(probes):
    x = np.arange(1, 257, dtype=np.float32)
    s, m = np.zeros(256, np.float32), np.zeros(256, np.float32)
    probes.get_function("block_reduce")(1, 256, (x, s, m))
    assert (s == x.sum()).all() and (m == 256).all()


def test_a_barrier_orders_shared_memory_and_without_it_unwritten_memory_shows(probes):
    k = probes.get_function("neighbour")
    out = np.zeros(64, np.float32)
    k(1, 64, (out, np.int32(1)), shared_mem=4 * 64)
    assert np.array_equal(out, 10 * ((np.arange(64) + 1) % 64).astype(np.float32))
    k(1, 64, (out, np.int32(0)), shared_mem=4 * 64)   # no barrier: thread t reads t+1 before it wrote
    assert np.isnan(out[:63]).all() and out[63] == 0.0


def test_coordinates_of_every_thread_in_a_3d_launch(probes):
    grid, block = (3, 2, 2), (8, 4, 2)
    nb, nt = 12, 64
    out = np.full((nb, nt, 4), -1, np.int32)
    k = probes.get_function("coords")
    k(grid, block, (out,))
    assert np.array_equal(out[..., 0], np.repeat(np.arange(nb)[:, None], nt, 1))
    assert np.array_equal(out[..., 1], np.repeat(np.arange(nt)[None], nb, 0))
    assert (out[..., 2] == nb).all() and (out[..., 3] == nt).all()
    assert k.last == {"blocks": 12, "passes": 12, "switches": 12 * 64}


def test_dp4a_popc_and_half_conversion_against_numpy(probes):
    rng = np.random.default_rng(2)
    a, b = (rng.integers(-2**31, 2**31, 1024, dtype=np.int64).astype(np.int32) for _ in range(2))
    c = rng.integers(-2**20, 2**20, 1024).astype(np.int32)
    d, p = np.zeros(1024, np.int32), np.zeros(1024, np.int32)
    probes.get_function("dp4a_popc")(8, 128, (a, b, c, d, p))
    prods = a.view(np.int8).reshape(-1, 4).astype(np.int64) * b.view(np.int8).reshape(-1, 4)
    assert np.array_equal(d, (prods.sum(1) + c).astype(np.int32))
    assert np.array_equal(p, [bin(v).count("1") for v in a.view(np.uint32).tolist()])
    h = np.arange(65536, dtype=np.uint16)                    # every half: normals, subnormals, inf, NaN
    f = np.zeros(65536, np.float32)
    probes.get_function("halves")(512, 128, (h, f))
    want = h.view(np.float16).astype(np.float32)
    assert np.array_equal(f.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("name, block, args, message", [
    ("early_return", 32, lambda: (np.ones(32, np.float32), np.int32(20)), "some of its lanes have returned"),
    ("diverged", 32, lambda: (np.ones(32, np.float32),), r"lane 0 waits at its shuffle 0 \(line \d+\), lane 1"),
    ("half_mask", 32, lambda: (np.ones(32, np.float32),), "only a full mask"),
    ("barrier_after_return", 128, lambda: (np.ones(128, np.float32),), r"__syncthreads\(\) after 64 of 128"),
    ("sums", 48, lambda: (np.ones(48, np.float32), np.ones(48, np.float32), np.ones(48)), "last warp is short"),
])
def test_what_cuda_leaves_undefined_is_a_named_error(probes, name, block, args, message):
    with pytest.raises(CudaOnCpuError, match=message):
        probes.get_function(name)(1, block, args())
    out = np.zeros(32, np.int32)                          # the runtime is usable after a failed launch
    probes.get_function("shuffle_once")(1, 32, (np.arange(32, dtype=np.int32), np.int32(1), out))
    assert np.array_equal(out, np.arange(32) ^ 1)


def test_launch_shapes_and_arguments_cuda_refuses(probes):
    k = probes.get_function("shuffle_once")
    x, out = np.zeros(64, np.int32), np.zeros(64, np.int32)
    for grid, block, match in [((0,), 32, "zero dimension"), (1, 2048, "more than 1024"),
                               ((1, 70000), 32, "over 65535"), ((1, 2, 3, 4), 32, "one to three"),
                               (-1, 32, r"in \[0, 2\^31\)")]:
        with pytest.raises(CudaOnCpuError, match=match):
            k(grid, block, (x, np.int32(1), out))
    with pytest.raises(CudaOnCpuError, match="2 arguments for 3"):
        k(1, 32, (x, out))
    with pytest.raises(CudaOnCpuError, match="does not fit a C int"):
        k(1, 32, (x, 2**40, out))
    with pytest.raises(CudaOnCpuError, match="C-contiguous numpy array"):
        k(1, 32, (x[::2], np.int32(1), out))
    with pytest.raises(CudaOnCpuError, match="227 KiB"):
        probes.get_function("neighbour")(1, 32, (out.view(np.float32), np.int32(1)), shared_mem=1 << 20)
    with pytest.raises(CudaOnCpuError, match="no kernel 'nope'"):
        probes.get_function("nope")


def test_bad_source_and_missing_compiler_are_named_errors(monkeypatch, tmp_path):
    monkeypatch.setenv("DS4REF_CACHE", str(tmp_path))
    with pytest.raises(CudaOnCpuError, match="does not compile"):
        CpuModule('extern "C" __global__ void k(float *x) { x[0] = undefined_name; }', (KDIR,)).compile()
    with pytest.raises(CudaOnCpuError, match="no extern"):
        build("int x;", [str(kernel_dir())])
    monkeypatch.setenv("CXX", "")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(CudaOnCpuError, match="no C\\+\\+ compiler"):
        compiler()


def test_a_build_is_compiled_once_and_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("DS4REF_CACHE", str(tmp_path))
    src = kernel_source("matvec.cu")
    first = build(src, [str(kernel_dir())])
    stamp = first.stat().st_mtime_ns
    assert build(src, [str(kernel_dir())]) == first and first.stat().st_mtime_ns == stamp
    assert build(src + "\n// changed\n", [str(kernel_dir())]) != first
    assert [p.suffix for p in tmp_path.rglob("*")].count(".so") == 2    # no leftover temporaries


def _q8_case(rows=200, n=2048, T=3):        # 64 blocks a row: every lane of a warp has two
    rng = np.random.default_rng(3)
    W = quantize(rng.standard_normal((rows, n)).astype(np.float32), 8)
    return W, quantize_q8_0(rng.standard_normal((T, n)).astype(np.float32))


def _run_q8(module, W, a):
    T, rows = a.qs.shape[0], W.shape[0]
    y = np.full((T, rows), np.nan, np.float32)
    module.get_function("matvec_q8_0_q8_0")(((rows + 3) // 4, T), 128, (
        W, np.int64(W.shape[1]), np.int32(rows), np.int32(a.d.shape[-1]), a.qs, a.d, y))
    return y


ORDER_PROBE = r"""
// block 0 writes x[0]; every other block copies it: a kernel that depends on block order
extern "C" __global__ void copy_first(float *x) {
    if (blockIdx.x == 0) { if (threadIdx.x == 0) x[0] = 1.0f; return; }
    if (threadIdx.x == 0) x[blockIdx.x] = x[0];
}
"""


def test_block_order_runs_every_block_once_in_a_seeded_random_order(probes):
    """block_order=seed: each launch sees every blockIdx exactly once (the coordinates kernel gives
    the in-order result), and a kernel that depends on the order gives another result."""
    grid, block = (3, 2, 2), (8, 4, 2)
    want = np.full((12, 64, 4), -1, np.int32)
    probes.get_function("coords")(grid, block, (want,))
    for seed in (0, 1, 2):
        got = np.full_like(want, -1)
        CpuModule(PROBES, (KDIR,), block_order=seed).get_function("coords")(grid, block, (got,))
        assert np.array_equal(got, want)
    ordered = np.zeros(8, np.float32)
    CpuModule(ORDER_PROBE, (KDIR,)).get_function("copy_first")(8, 32, (ordered,))
    assert (ordered == 1).all()
    shuffled = [np.zeros(8, np.float32) for _ in range(2)]
    for x in shuffled:      # the same seed draws the same order
        CpuModule(ORDER_PROBE, (KDIR,), block_order=1).get_function("copy_first")(8, 32, (x,))
    assert np.array_equal(*shuffled) and (shuffled[0] == 0).any()


def test_the_sanitizer_build_stops_a_read_past_an_array():
    """extra_flags reach the compiler: with SANITIZERS (in a process with ASan preloaded) a Q8_0
    launch told of one row more than the weights hold is stopped at the read."""
    import shutil
    import subprocess
    from ds4ref.dev.cuda_on_cpu import sanitized_python
    gxx = shutil.which("g++")
    if gxx is None or not subprocess.run([gxx, "-print-file-name=libasan.so"], capture_output=True,
                                         text=True).stdout.strip().startswith("/"):
        pytest.skip("needs g++ with its AddressSanitizer runtime")
    code = """
import sys, numpy as np
from ds4ref.backends.cupy_kernels import kernel_dir, kernel_source
from ds4ref.dev.cuda_on_cpu import SANITIZERS, CpuModule
rows = int(sys.argv[1])
W = np.zeros((8, 34), np.uint8)
qs, d, y = np.zeros(32, np.int8), np.zeros(1, np.float32), np.zeros(rows, np.float32)
k = CpuModule(kernel_source("matvec.cu"), (f"-I{kernel_dir()}",), extra_flags=SANITIZERS)
k.get_function("matvec_q8_0_q8_0")((-(-rows // 4),), (128,),
                                   (W, np.int64(34), np.int32(rows), np.int32(1), qs, d, y))
print("ran")
"""
    fine = sanitized_python(code, "8")
    assert fine.returncode == 0 and fine.stdout.strip() == "ran", fine.stderr[-2000:]
    past = sanitized_python(code, "9")
    assert past.returncode != 0 and "heap-buffer-overflow" in past.stderr, past.stderr[-2000:]


def test_the_ucontext_build_gives_the_same_bits():
    W, a = _q8_case()
    src = kernel_source("matvec.cu")
    fast = _run_q8(CpuModule(src, (KDIR,)), W, a)
    portable = _run_q8(CpuModule(src, (KDIR,), defines=("DS4_CUDA_ON_CPU_UCONTEXT",)), W, a)
    assert np.array_equal(fast.view(np.uint32), portable.view(np.uint32))
    assert rel(fast, matvec_q8_0_prequant(W, a)) < 1e-6


def test_a_planted_bug_in_the_kernel_source_is_caught():
    """The parity checks can fail: warp_sum's rounds started at offset 8 leave half the warp out.
    Not with rows of 16 blocks or fewer: lanes 16-31 then hold zeros, and the slip is invisible."""
    W, a = _q8_case()
    short = _q8_case(n=512)
    common = kernel_source("ds4_common.cuh")
    slip = common.replace("for (int o = 16; o > 0;", "for (int o = 8; o > 0;", 1)
    assert slip != common
    src = kernel_source("matvec.cu").replace('#include "ds4_common.cuh"', slip)
    assert rel(_run_q8(CpuModule(src, (KDIR,)), W, a), matvec_q8_0_prequant(W, a)) > 0.1
    assert rel(_run_q8(CpuModule(src, (KDIR,)), *short), matvec_q8_0_prequant(*short)) < 1e-6


def test_every_backend_kernel_compiles_for_the_cpu():
    found = set()
    for f in KERNEL_FILES:
        m = CpuModule(kernel_source(f), (KDIR,))
        m.compile()
        found |= {k for k in m.sigs if hasattr(m.lib, f"cuda_on_cpu_{k}")}
    assert found == set(KERNEL_NAMES)


@pytest.mark.parametrize("T", [2, 7, 8, 9, 20])
def test_the_prefill_kernel_gives_each_token_the_decode_kernels_bits(T):
    """matmul_q8_0_q8_0 (8 tokens per weight read) against matvec_q8_0_q8_0 token by token: the same
    floats (same lane order, same warp_sum; no FMA contraction in the CPU build), and chapter 3 within
    float rounding; a T that is not a multiple of 8 leaves no output unwritten."""
    W, a = _q8_case(rows=66, T=T)
    module = CpuModule(kernel_source("matvec.cu"), (KDIR,))
    rows = W.shape[0]
    y = np.full((T, rows), np.nan, np.float32)
    module.get_function("matmul_q8_0_q8_0")(((rows + 3) // 4, -(-T // 8)), 128, (
        W, np.int64(W.shape[1]), np.int32(rows), np.int32(a.d.shape[-1]), np.int32(T), a.qs, a.d, y))
    assert np.array_equal(y.view(np.uint32), _run_q8(module, W, a).view(np.uint32))
    assert rel(y, matvec_q8_0_prequant(W, a)) < 1e-6


def test_the_cupy_backend_takes_the_prefill_kernel_from_two_tokens():
    from ds4ref.backends.cupy_backend import CupyBackend
    from ds4ref.dev.cuda_on_cpu import source_standin
    cp = source_standin()
    be = CupyBackend(cp=cp).strict()
    W, a = _q8_case(rows=40, T=11)
    assert rel(be.matvec_q8_0_prequant(W, a), matvec_q8_0_prequant(W, a)) < 1e-6
    one = type(a)(a.qs[0], a.d[0])
    assert rel(be.matvec_q8_0_prequant(W, one), matvec_q8_0_prequant(W, one)) < 1e-6
    assert cp.launched == {"matmul_q8_0_q8_0": 1, "matvec_q8_0_q8_0": 1}


def test_the_cuda_prefill_benchmark_launches_both_kernels_as_their_sources_declare():
    """The benchmark only times on a GPU; here its launches run through the kernels' source (a wrong
    argument list would fail on the lent GPU machine, after the wait for one)."""
    from ds4ref.backends.cupy_backend import CupyBackend
    from ds4ref.dev.bench_cuda import bench_q8_0_prefill
    from ds4ref.dev.cuda_on_cpu import source_standin
    cp = source_standin()
    row = bench_q8_0_prefill(CupyBackend(cp=cp), np.random.default_rng(0), lambda fn: (fn(), 0.5)[1], cp,
                             T=20, n=1024, rows=64)
    assert row == {"tokens": 20, "n": 1024, "rows": 64, "one_token_kernel_tok_s": 40.0, "matmul_tok_s": 40.0,
                   "ratio": 1.0}
    assert cp.launched == {"matvec_q8_0_q8_0": 1, "matmul_q8_0_q8_0": 1}
