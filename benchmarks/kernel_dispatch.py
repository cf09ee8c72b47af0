"""Which operations give other floats under which kernels, and what the pinned kernels cost.

Each level below is what the environment asks of PyTorch's ATen, oneDNN, MKL, NumPy and OpenBLAS (the machine's
own choice first). For each, a fresh interpreter computes a set of operations on fixed inputs with the pins
lifted, and prints a digest of each result's bytes: an operation whose digest changes with the level gives
other floats on CPUs whose libraries choose differently. Then the same short run (LeNet-5 with batch norm on
Fashion-MNIST) is timed with the machine's own kernels and with the pinned ones.

    .venv/bin/python benchmarks/kernel_dispatch.py
"""
import json
import os
import subprocess
import sys
import time

from fedlab_core import kernels

LEVELS = {
    "machine's own": {},
    "AVX-512, no AMX": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "MKL_CBWR": "AVX512",
                        "OPENBLAS_CORETYPE": "SkylakeX"},
    "AVX2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "AVX2",
             "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR", "OPENBLAS_CORETYPE": "Haswell"},
    "pinned": dict(kernels.PINS),
    "SSE4": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_CBWR": "SSE4_2",
             "NPY_DISABLE_CPU_FEATURES": "X86_V3 X86_V4 AVX512_ICL AVX512_SPR"},
}

OPS = r'''
import hashlib, json, numpy as np, torch, torch.nn.functional as F
torch.set_num_threads(1)
rng = np.random.default_rng(0)
def r(*s): return torch.from_numpy(rng.standard_normal(s).astype(np.float32))
def h(t): return hashlib.sha256(np.ascontiguousarray(t.detach().numpy() if torch.is_tensor(t) else t).tobytes()).hexdigest()[:8]
out = {}
x, w = r(32, 3, 28, 28).requires_grad_(), r(6, 3, 5, 5).requires_grad_()
y = F.conv2d(x, w); y.square().sum().backward()
out.update({"conv2d 3->6 (oneDNN)": h(y), "conv2d 3->6 backward, weights": h(w.grad), "conv2d 3->6 backward, input": h(x.grad)})
x, w = r(32, 6, 12, 12).requires_grad_(), r(16, 6, 5, 5).requires_grad_()
y = F.conv2d(x, w); y.square().sum().backward()
out.update({"conv2d 6->16 (oneDNN)": h(y), "conv2d 6->16 backward, weights": h(w.grad), "conv2d 6->16 backward, input": h(x.grad)})
a, v = r(32, 400).requires_grad_(), r(120, 400).requires_grad_()
z = F.linear(a, v); z.square().sum().backward()
out.update({"linear (MKL sgemm)": h(z), "linear backward": h(v.grad)})
b = r(32, 6, 24, 24).requires_grad_()
n = F.batch_norm(b, None, None, training=True); n.square().sum().backward()
out.update({"batch norm": h(n), "batch norm backward": h(b.grad)})
logits = r(32, 10).requires_grad_(); F.cross_entropy(logits, torch.arange(32) % 10).backward()
out.update({"log_softmax": h(F.log_softmax(r(64, 1000), 1)), "cross-entropy backward": h(logits.grad)})
u = r(100000)
out.update({"exp": h(u.exp()), "tanh": h(u.tanh()), "sum": h(u.sum()), "max_pool2d": h(F.max_pool2d(r(8, 6, 24, 24), 2))})
torch.manual_seed(0); out["randn"] = h(torch.randn(1000))
d = rng.standard_normal(100000)
out.update({"numpy exp (float64)": h(np.exp(d)), "numpy log (float64)": h(np.log(np.abs(d) + 1)),
            "numpy dot (OpenBLAS)": h(d @ d), "numpy matmul (OpenBLAS)": h(rng.standard_normal((64, 80)) @ rng.standard_normal((80, 90)))})
print(json.dumps(out))
'''

RUN = r'''
import time, fedlab_core
from fedlab_core.runs import RunConfig, run
config = RunConfig(dataset="fashion_mnist", model="lenet5_bn", num_clients=10, num_rounds=3, batch_size=32, lr=0.05,
                   local_epochs=1, max_train_samples=3000, max_test_samples=1000, seed=0)
run(config.replace(num_rounds=1), use_cache=False, workers=1, progress=False)
start = time.perf_counter(); run(config, use_cache=False, workers=1, progress=False)
print(time.perf_counter() - start)
'''


# each library reads its choice at its first kernel: run one of each before fedlab_core's import pins them
WARM = ("import numpy, torch, torch.nn.functional as F\nF.conv2d(torch.ones(1, 1, 4, 4), torch.ones(1, 1, 2, 2))\n"
        "torch.ones(4, 4) @ torch.ones(4, 4); torch.ones(4).exp()\n")


def fresh(code: str, level: dict[str, str], pinned: bool) -> str:
    """`code`'s last line of output in a new interpreter asking for `level` (the pins lifted unless `pinned`)."""
    env = {k: v for k, v in os.environ.items() if k not in kernels.PINS}
    env.update(level)
    prelude = "" if pinned else f"import os; os.environ.update({({k: '' for k in kernels.PINS} | level)!r})\n"
    if not pinned:  # the start-up hook pinned the interpreter: undo it before any library loads
        prelude += "[os.environ.pop(k) for k in list(os.environ) if not os.environ[k]]\n"
    done = subprocess.run([sys.executable, "-c", prelude + code], env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


def main() -> None:
    digests = {name: json.loads(fresh(OPS, level, pinned=False)) for name, level in LEVELS.items()}
    names = list(LEVELS)
    print("operation".ljust(32) + "".join(n[:16].ljust(17) for n in names))
    for op in digests[names[0]]:
        row = [digests[n][op] for n in names]
        mark = "" if len(set(row)) == 1 else "   <- differs"
        print(op.ljust(32) + "".join(d.ljust(17) for d in row) + mark)
    own = float(fresh(WARM + RUN, {}, pinned=False))
    pinned = float(fresh(RUN, {}, pinned=True))
    print(f"\nFedAvg, LeNet-5-BN, 10 clients, 3 rounds, one thread: the machine's own kernels {own:.2f} s, the pinned "
          f"ones {pinned:.2f} s (ratio {pinned / own:.2f})")


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"({time.perf_counter() - start:.0f} s)")
