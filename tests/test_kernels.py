"""The CPU kernels are pinned, so a run's numbers are the same on every x86-64 CPU with AVX2: whatever kernels the
environment asks for, a run computes the same numbers; a pin that comes too late is caught; every run records
the kernels it computed with, and the cache tells runs of other kernels apart."""
import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from fedlab_core import kernels, store
from fedlab_core.runs import RunConfig

needs_pins = pytest.mark.skipif(not kernels.pinnable(), reason="the pins reach x86-64 CPUs with AVX2 and FMA only")

# what the environment may ask of each library: the machine's best, AVX-512 without AMX, AVX2, and below AVX2
LEVELS = {
    "native": {},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "MKL_CBWR": "AVX512",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512", "OPENBLAS_CORETYPE": "SkylakeX"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2", "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR"},
    "sse4": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_CBWR": "SSE4_2",
             "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "NPY_DISABLE_CPU_FEATURES": "X86_V3 X86_V4 AVX512_ICL AVX512_SPR"},
}
RUN = RunConfig(dataset="fashion_mnist", model="lenet5_bn", num_clients=3, num_rounds=2, eval_every=1, batch_size=32,
                lr=0.05, local_epochs=1, max_train_samples=300, max_test_samples=200, seed=0)


def _python(code: str, level: dict[str, str]) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter of this environment whose environment asks for `level`'s kernels; the code
    sets them again itself first, so they stand even where the environment's start-up hook pinned them."""
    env = {k: v for k, v in os.environ.items() if k not in kernels.PINS and not k.startswith("MKL_")}
    env.update(level)
    prelude = f"import os; os.environ.update({level!r})\n"
    return subprocess.run([sys.executable, "-c", prelude + code], env=env, capture_output=True, text=True, timeout=300)


@needs_pins
@pytest.mark.slow
def test_every_kernel_level_the_environment_asks_for_gives_the_same_numbers_once_pinned():
    pinned = ("import json, fedlab_core\nfrom fedlab_core import kernels\nfrom fedlab_core.runs import RunConfig, run\n"
              f"h = run(RunConfig(**{RUN.to_dict()!r}), use_cache=False, workers=1, device='cpu', progress=False)\n"
              "rows = [{k: v for k, v in r.items() if 'seconds' not in k} for r in h.rounds]\n"
              "print(json.dumps([kernels.signature(), rows]))")
    # the same canary without the pins: the kernels module loaded on its own, so nothing is pinned
    unpinned = (f"import importlib.util\nspec = importlib.util.spec_from_file_location('k', {kernels.__file__!r})\n"
                "k = importlib.util.module_from_spec(spec); spec.loader.exec_module(k)\nprint(k.canary())")
    # Unpinned, a level the CPU lacks is the libraries' to refuse: on an AVX2-only AMD EPYC, asking for AVX-512
    # kills the control with an illegal instruction (SIGILL); the pinned run at that level must still compute.
    results, controls = {}, {}
    for name, level in LEVELS.items():
        done = _python(pinned, level)
        assert done.returncode == 0, done.stderr[-2000:]
        results[name] = json.loads(done.stdout.splitlines()[-1])
        if name == "avx512" and "avx512f" not in kernels.cpu_flags():
            continue
        control = _python(unpinned, level)
        assert control.returncode == 0, control.stderr[-2000:]
        controls[name] = control.stdout.split()[-1]
    signatures = {name: sig for name, (sig, _) in results.items()}
    assert all(sig["canary"] == kernels.PINNED_CANARY and sig["isa"] == "AVX2" and sig["pins"] == kernels.PINS
               for sig in signatures.values()), signatures
    rows = {name: r for name, (_, r) in results.items()}
    assert all(r == rows["native"] for r in rows.values()) and len(rows["native"]) == 2
    # the levels do change the kernels where the pins are absent (so the equality above is not vacuous)
    assert controls["sse4"] != controls["avx2"], controls
    if "avx512f" in kernels.cpu_flags():
        assert len(set(controls.values())) == 4, controls


@needs_pins
def test_a_pin_that_comes_after_the_first_kernel_is_caught_before_a_run_is_archived():
    late = ("import torch\ntorch.ones(64).exp().sum()\nx = torch.ones(8, 8); x @ x\n"
            "import fedlab_core\nfrom fedlab_core import kernels\nkernels.check_pinned()")
    done = _python(late, LEVELS["sse4"])
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: kernels: not the pinned ones (") and "import fedlab_core before" in last


@needs_pins
def test_every_python_process_of_the_environment_starts_pinned():
    """`make env` installs the start-up hook: a process that never imports fedlab_core computes pinned too
    (a notebook's kernel, a tool's subprocess), and NumPy, which `import torch` imports, is pinned in time."""
    hook = Path(sysconfig.get_paths()["purelib"]) / "fedlab_kernels.pth"
    assert hook.exists(), f"{hook} is missing: make env installs it"
    env = {k: v for k, v in os.environ.items() if k not in kernels.PINS}
    env.update(LEVELS["avx512"])
    code = ("import os, torch\nprint(torch.backends.cpu.get_cpu_capability()); "
            f"print('|'.join(os.environ.get(k, '') for k in {sorted(kernels.PINS)!r}))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines() == ["AVX2", "|".join(kernels.PINS[k] for k in sorted(kernels.PINS))], done.stderr


def test_the_signature_names_the_kernels_and_the_cache_tells_other_kernels_apart(monkeypatch):
    sig = kernels.signature()
    assert set(sig) == {"arch", "flags", "isa", "pins", "canary"} and len(sig["canary"]) == 12
    assert kernels.canary() == sig["canary"]                       # the same digest every time in one process
    key = store.cache_key(RUN, torch.device("cpu"))
    monkeypatch.setattr(store, "canary", lambda: "0123456789ab")
    assert store.cache_key(RUN, torch.device("cpu")) != key        # a run cached under other kernels is not read
    assert store.archive_key(RUN, "cpu") == store.archive_key(RUN, torch.device("cpu"))   # the archive's is not
    assert "not recorded" in kernels.describe(None) and sig["canary"] in kernels.describe(sig)


def test_the_square_root_is_the_ieee_one_which_every_cpu_computes_alike():
    """MKL's vector square root, which PyTorch's CPU sqrt calls, misrounds about a sixth of float32 results, and
    differently on Intel and AMD CPUs (Adam, cdist and FedFA's statistics then part from round 1); fedlab_core
    replaces it with the correctly rounded one, which NumPy computes with the CPU's own instruction."""
    import numpy as np

    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        x = np.abs(rng.standard_normal(4096)).astype(dtype) + dtype(0.1)
        ieee = np.sqrt(x)
        t = torch.from_numpy(x)
        assert np.array_equal(t.sqrt().numpy(), ieee) and np.array_equal(torch.sqrt(t[::3]).numpy(), ieee[::3])
        out = torch.empty(0, dtype=t.dtype)
        torch.sqrt(t, out=out)
        inplace = t.clone().sqrt_()
        [foreach] = torch._foreach_sqrt([t])
        torch._foreach_sqrt_([t2 := t.clone()])
        assert all(np.array_equal(r.numpy(), ieee) for r in (out, inplace, foreach, t2))
    assert torch.tensor([4, 9]).sqrt().tolist() == [2.0, 3.0] and torch.tensor(4.0).sqrt().item() == 2.0
    assert torch.empty(0, 3).sqrt().shape == (0, 3) and torch.zeros(2, 3).t().sqrt().shape == (3, 2)
    assert torch.tensor(2.0, dtype=torch.bfloat16).sqrt().dtype == torch.bfloat16
    x = torch.tensor([0.25, 4.0], requires_grad=True)                  # autograd's formula is PyTorch's own
    x.sqrt().sum().backward()
    assert x.grad.tolist() == [1.0, 0.25]
    step = torch.nn.Parameter(torch.tensor([1.0, 2.0]))                # Adam's step reads the same square root
    opt = torch.optim.Adam([step], lr=0.1)
    step.grad = torch.tensor([0.3, -0.7])
    opt.step()
    assert step.tolist() == pytest.approx([0.9, 2.1], abs=1e-6)
    # a fresh process that imports fedlab_core (a worker, a notebook's kernel) gets it too
    code = ("import fedlab_core, numpy as np, torch\nx = np.linspace(0.1, 9.0, 5000, dtype=np.float32)\n"
            "print(np.array_equal(torch.from_numpy(x).sqrt().numpy(), np.sqrt(x)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["True"], done.stderr[-2000:]


EMULATED = os.environ.get("FEDLAB_EMULATED_CPU")


@pytest.mark.skipif(not (EMULATED and shutil.which("qemu-x86_64")), reason="set FEDLAB_EMULATED_CPU (e.g. Haswell) "
                    "with Debian's qemu-user installed to verify archived runs on an emulated CPU (minutes)")
def test_archived_runs_verify_bit_for_bit_on_an_emulated_cpu(tmp_path):
    """The first round of the cheapest archived runs of distinct groups, re-run on another CPU model (qemu's
    emulation: a Haswell has AVX2 but no AVX-512), is bit-identical to the stored numbers, and the canary is
    the pinned one: the pins reach that CPU."""
    archive = store.Archive()
    chosen: dict[tuple, tuple[float, str]] = {}
    for key, h in archive.entries():
        if (h.meta.get("kernels") or {}).get("canary") == kernels.PINNED_CANARY:
            cost = (h.meta.get("seconds") or 0.0) / max(len(h.rounds), 1)
            group = (h.config["algorithm"], h.config["augment"], h.config["model"])
            chosen[group] = min(chosen.get(group, (math.inf, "")), (cost, key))
    keys = [key for _, key in sorted(chosen.values())[:int(os.environ.get("FEDLAB_EMULATED_RUNS", "3"))]]
    assert keys, "the archive holds no run computed with the pinned kernels"
    for key in keys:
        shutil.copy(archive.path(key), tmp_path)
    code = ("import json\nfrom fedlab_core import kernels, store\nfrom fedlab_core.runs import rerun\n"
            "from fedlab_core.verification import verify\n"
            f"checks = verify(lambda h, k: rerun(h, k, workers=1), store.Archive({str(tmp_path)!r}), rounds=1, "
            "every=True, progress=False)\n"
            "print(json.dumps([kernels.signature()['canary'], [str(c) for c in checks], all(c.first_difference is None "
            "and c.same_kernels for c in checks)]))")
    done = subprocess.run(["qemu-x86_64", "-cpu", EMULATED, sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=3600)
    assert done.returncode == 0, done.stderr[-2000:]
    canary, checks, identical = json.loads(done.stdout.splitlines()[-1])
    print(f"on an emulated {EMULATED}:", *checks, sep="\n")
    assert canary == kernels.PINNED_CANARY and identical and len(checks) == len(keys), checks


def test_a_cuda_device_computes_with_deterministic_kernels_and_the_callers_settings_come_back(monkeypatch):
    # no GPU needed: the settings are PyTorch's flags and cuBLAS's variable, set and read without one
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    kernels.pin()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"          # the user's own value stays
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    kernels.pin()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    before = kernels.cuda_determinism()
    with kernels.deterministic(torch.device("cpu")):
        assert kernels.cuda_determinism() == before                  # a CPU run's kernels are left as they are
    with kernels.deterministic(torch.device("cuda", 0)):
        assert kernels.cuda_determinism() == {"algorithms": True, "cudnn_deterministic": True,
                                              "cudnn_benchmark": False, "cublas_workspace": ":4096:8", "tf32": False}
    assert kernels.cuda_determinism() == before
