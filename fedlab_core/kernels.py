"""The CPU kernels a run computes with, pinned so that its numbers are the same on every x86-64 CPU with AVX2.

Why: PyTorch, oneDNN, MKL, NumPy and OpenBLAS each choose their kernels by the CPU they find. On the same
inputs, an AVX-512 kernel and an AVX2 kernel round differently (other reduction widths, other blockings), so
a run computed on a CPU with AVX-512 differs from round 1 from the same run on a CPU without it. Measured
operation by operation (``benchmarks/kernel_dispatch.py``):

- ATen (``ATEN_CPU_CAPABILITY``): ``log_softmax`` and the cross-entropy's backward, ``tanh``, ``randn``;
- oneDNN (``ONEDNN_MAX_CPU_ISA``): the input gradient of convolutions with more channels (``jit:avx512_core``
  against ``jit:avx2``), and below AVX2 every convolution;
- MKL (``MKL_CBWR``): every matrix product (linear layers), and the vector maths behind ``exp``.
  MKL's AVX2 branch differs between Intel and AMD CPUs (its reproducible branches are Intel's); its
  ``COMPATIBLE`` branch (SSE2) is the one every x86-64 CPU computes alike;
- NumPy (``NPY_DISABLE_CPU_FEATURES``): float64 ``exp`` and ``log`` (OT alignment's Sinkhorn iterations);
- OpenBLAS (``OPENBLAS_CORETYPE``): NumPy's and SciPy's dot products;
- the square root: PyTorch's CPU ``sqrt`` calls MKL's vector square root, which is not correctly rounded (a
  sixth of float32 results differ from the IEEE square root in the last bit) and differs between Intel and AMD
  CPUs whatever ``MKL_CBWR`` says (Adam's step, ``cdist``, FedFA's feature statistics). No variable reaches it:
  :func:`exact_sqrt` replaces the kernel with the IEEE square root, which every CPU computes alike.

:func:`pin` sets each library's choice before its first kernel runs. NumPy reads its choice when it is imported,
and ``import torch`` imports NumPy, so the pins are set at the interpreter's start: ``make env`` installs
:func:`startup_hook` into the environment (a ``.pth`` file, which Python runs before any other code), so every
Python process of the environment, a notebook's kernel, a worker or a test's subprocess, starts pinned.
``import fedlab_core`` pins too, for an environment without the hook (where it is too late, :func:`canary`
shows it and the archive refuses the run: :func:`check_pinned`). Every run records
:func:`signature` in its meta; two machines with the same signature compute the same numbers, and
:func:`fedlab_core.verification.verify` fails on any difference there. A CPU the pins cannot reach (another
architecture, no AVX2) has another signature: verification there reports the largest difference instead.

On a CUDA device, :func:`deterministic` holds a run to deterministic kernels (PyTorch's deterministic algorithms,
cuDNN's deterministic convolutions without autotuning, and cuBLAS's fixed workspace, which :func:`pin` sets before
cuBLAS starts), so two runs of one config on one GPU give the same numbers; a CUDA run records them in its meta
(:func:`cuda_determinism`).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
from pathlib import Path
from typing import Iterator

# what each library is held to on an x86-64 CPU with AVX2 and FMA (every such CPU runs these kernels alike)
PINS = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_CBWR": "COMPATIBLE",
    "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR",
    "OPENBLAS_CORETYPE": "Haswell",
}
NEEDED_FLAGS = ("avx2", "fma")
# the CPU flags that change which kernels run, recorded in the signature
FLAGS_THAT_MATTER = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile")
# the canary's digest under the pins, on any x86-64 CPU with AVX2 (measured natively on Intel with AVX-512 and
# AMX, and on an emulated Haswell, without AVX-512)
PINNED_CANARY = "bc211e952aa0"
# cuBLAS's workspace under which its matrix products are deterministic, read once when cuBLAS starts
CUBLAS_WORKSPACE = ("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def _cpuinfo(field: str) -> str | None:
    """The first value of `field` in Linux's /proc/cpuinfo, or None where it is not readable."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty where /proc/cpuinfo is not readable)."""
    return frozenset((_cpuinfo("flags") or "").split())


def cpu_model() -> str:
    """The CPU's model name, for the record (the signature, not this, decides whether floats can differ)."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def pinnable() -> bool:
    """Whether the pins reach this CPU: x86-64 with AVX2 and FMA."""
    return platform.machine() in ("x86_64", "AMD64") and set(NEEDED_FLAGS) <= cpu_flags()


def pin() -> None:
    """Hold every library to the kernels of :data:`PINS`, whatever the environment asked for, where the CPU
    allows it (elsewhere nothing is set: the kernels stay the libraries' own, and :func:`signature` says so).
    It must run before the libraries' first kernel (``import fedlab_core`` does it first); the variables are
    inherited by every process started from this one. It also sets cuBLAS's :data:`CUBLAS_WORKSPACE`, unless the
    environment holds one (":16:8" is deterministic too), for :func:`deterministic`."""
    os.environ.setdefault(*CUBLAS_WORKSPACE)
    if pinnable():
        os.environ.update(PINS)


_SQRT_KERNELS = []   # the library holding the replaced square-root kernels (alive as long as the process)


def _ieee_sqrt(x):
    """The IEEE (correctly rounded) square root of a CPU tensor, by NumPy (the CPU's own instruction), in the dtype
    ``torch.sqrt`` gives (a float dtype for an integer tensor; bfloat16 through float32, exact after rounding)."""
    import numpy as np
    import torch

    dtype = x.dtype if (x.is_floating_point() or x.is_complex()) else torch.get_default_dtype()
    work = torch.float32 if dtype == torch.bfloat16 else dtype
    a = x.detach().to(work).contiguous().numpy()
    return torch.from_numpy(np.sqrt(a, out=np.empty_like(a))).to(dtype)


def exact_sqrt() -> None:
    """Replace PyTorch's CPU square root (``sqrt``, ``sqrt_``, ``sqrt.out``, ``_foreach_sqrt``, ``_foreach_sqrt_``)
    by :func:`_ieee_sqrt` in this process, once: MKL's, which PyTorch calls, rounds differently on Intel and AMD
    CPUs. Autograd's formula (``grad / (2 * result)``) and other devices' kernels are PyTorch's own."""
    if _SQRT_KERNELS:
        return
    import warnings

    import torch

    def out_variant(x, *, out):
        result = _ieee_sqrt(x)
        out.resize_(result.shape)
        return out.copy_(result)

    def foreach_(xs):
        for x in xs:
            x.copy_(_ieee_sqrt(x))

    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():   # "overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore")
        lib.impl("sqrt", _ieee_sqrt, "CPU")
        lib.impl("sqrt_", lambda x: x.copy_(_ieee_sqrt(x)), "CPU")
        lib.impl("sqrt.out", out_variant, "CPU")
        lib.impl("_foreach_sqrt", lambda xs: [_ieee_sqrt(x) for x in xs], "CPU")
        lib.impl("_foreach_sqrt_", foreach_, "CPU")
    _SQRT_KERNELS.append(lib)


def startup_hook() -> Path:
    """Write ``fedlab_kernels.pth`` into this environment's site-packages: one line that :func:`pin` s every
    Python process of the environment at its start, before any library is imported. Returns its path."""
    import sysconfig

    line = (f"import os, platform; os.environ.update({PINS!r}) if platform.machine() in ('x86_64', 'AMD64') and "
            f"os.path.exists('/proc/cpuinfo') and {set(NEEDED_FLAGS)!r} <= set(next((l.split(':', 1)[1].split() "
            "for l in open('/proc/cpuinfo') if l.startswith('flags')), ())) else None\n")
    path = Path(sysconfig.get_paths()["purelib"]) / "fedlab_kernels.pth"
    path.write_text(line)
    return path


@functools.lru_cache(maxsize=1)
def canary() -> str:
    """A digest of the bytes a small set of kernels produce on fixed inputs: a convolution forward and
    backward (oneDNN), a linear layer forward and backward (MKL), ``log_softmax``, the cross-entropy's
    backward, batch norm, ``exp``, ``tanh`` and a sum (ATen, MKL's vector maths), ``randn``, and NumPy's
    ``exp``, ``log`` and dot product (NumPy, OpenBLAS). Two processes with the same digest ran the same
    kernels on these operations."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    def data(*shape: int, salt: int = 0) -> np.ndarray:  # exact integer arithmetic: the same on every CPU
        i = np.arange(int(np.prod(shape)), dtype=np.int64) + salt * 1_000_003
        return (((i * 2654435761) % 4093) / 4093.0 - 0.5).reshape(shape)

    def t(*shape: int, salt: int = 0) -> torch.Tensor:
        return torch.from_numpy(data(*shape, salt=salt).astype(np.float32)).requires_grad_()

    digest = hashlib.sha256()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x, w, b = t(16, 3, 12, 12), t(6, 3, 5, 5, salt=1), t(6, salt=2)
        y = F.conv2d(x, w, b)
        y.square().sum().backward()
        a, v = t(16, 150, salt=3), t(40, 150, salt=4)
        z = F.linear(a, v)
        z.square().sum().backward()
        logits = t(16, 10, salt=5)
        labels = torch.from_numpy(np.arange(16) % 10)
        loss = F.cross_entropy(logits, labels)
        loss.backward()
        u = t(4000, salt=6).detach()
        bn = F.batch_norm(y.detach(), None, None, training=True)
        torch.manual_seed(0)
        for out in (y, x.grad, w.grad, z, a.grad, v.grad, loss, logits.grad, F.log_softmax(logits, 1), bn,
                    u.exp(), u.tanh(), u.sum(), torch.randn(257)):
            digest.update(out.detach().contiguous().numpy().tobytes())
        d = data(4000, salt=7)
        for out in (np.exp(d), np.log(d + 1.0), d @ d, data(30, 40) @ data(40, 50, salt=8)):
            digest.update(np.ascontiguousarray(out).tobytes())
    finally:
        torch.set_num_threads(before)
    return digest.hexdigest()[:12]


@functools.lru_cache(maxsize=1)
def signature() -> dict[str, object]:
    """What decides this process's floats on the CPU: the architecture, the CPU flags that change kernels,
    ATen's kernel level, the pins in effect (None where the CPU cannot take them) and the :func:`canary`."""
    import torch

    flags = cpu_flags()
    pinned = pinnable() and all(os.environ.get(k) == v for k, v in PINS.items())
    return {"arch": platform.machine(), "flags": [f for f in FLAGS_THAT_MATTER if f in flags],
            "isa": torch.backends.cpu.get_cpu_capability(), "pins": dict(PINS) if pinned else None,
            "canary": canary()}


def cuda_determinism() -> dict[str, object]:
    """The settings in force that decide whether CUDA computes the same floats twice (a CUDA run's meta records
    them): PyTorch's deterministic algorithms, cuDNN's deterministic mode and autotuning, cuBLAS's workspace."""
    import torch

    return {"algorithms": torch.are_deterministic_algorithms_enabled(),
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "cublas_workspace": os.environ.get(CUBLAS_WORKSPACE[0]),
            "tf32": torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32}


@contextlib.contextmanager
def deterministic(device) -> Iterator[None]:
    """On a CUDA `device`, deterministic kernels inside the block (the caller's settings restored after): PyTorch's
    deterministic algorithms (an operation that has none raises, naming itself), cuDNN's deterministic
    convolutions, no cuDNN autotuning (it picks kernels by timing them), and float32 arithmetic where PyTorch would
    let convolutions use TF32 (its ten-bit mantissa moves a run's numbers by about 1e-3 from one kernel to
    another, so that two executors' runs part after a few rounds). On any other device nothing changes:
    the deterministic algorithms would replace some CPU kernels (an accumulating ``index_put_``, for one), and a
    CPU run's kernels are pinned already (:func:`pin`)."""
    import torch

    if device.type != "cuda":
        yield
        return
    cudnn = torch.backends.cudnn
    matmul = torch.backends.cuda.matmul
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              cudnn.deterministic, cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32)
    torch.use_deterministic_algorithms(True)
    cudnn.deterministic, cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32 = True, False, False, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        cudnn.deterministic, cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32 = before[2:]


def describe(sig: dict[str, object] | None) -> str:
    """A signature in a few words, for messages."""
    if not sig:
        return "not recorded (computed before the kernels were pinned)"
    pins = "pinned to x86-64 AVX2" if sig.get("pins") else "not pinned"
    return f"{sig.get('arch')}, ATen {sig.get('isa')}, {pins}, canary {sig.get('canary')}"


def check_pinned(sig: dict[str, object] | None = None) -> None:
    """Raise RuntimeError, in one line, unless `sig` (a run's recorded signature; this process's by default) is
    that of the pinned kernels: the archive takes no other runs, so that every archived number verifies on
    every x86-64 machine with AVX2."""
    sig = signature() if sig is None else sig
    if sig.get("canary") == PINNED_CANARY:
        return
    if not pinnable():
        raise RuntimeError(f"kernels: the archive takes runs computed on x86-64 CPUs with AVX2 and FMA only; this "
                           f"run's kernels: {describe(sig)}")
    raise RuntimeError(f"kernels: not the pinned ones ({describe(sig)}, expected canary {PINNED_CANARY}): import "
                       "fedlab_core before any other code runs a PyTorch or NumPy operation")
