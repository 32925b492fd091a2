"""The native CPU kernels: picked from the running CPU's flags, JIT-built once, cached.

``kernels/native/csrc/*.cpp`` are compiled by ``torch.utils.cpp_extension`` (ninja)
for the best instruction set this CPU has: ``avx512bf16`` (AVX-512 with bf16 dot
products), ``avx512vnni``, ``avx512``, ``avxvnni`` (AVX2 with 256-bit VNNI), ``avx2`` (with
FMA and F16C), else plain C++. The build lands
in torch's extension cache (``TORCH_EXTENSIONS_DIR``), so only the first process
on a machine pays for it. Where no compiler or ninja is present the model keeps
ATen's kernels, and says so in one warning. A build that fails with a compiler present
is a bug in ``csrc/``: the model still falls back (logged as an error), but ``require``
raises, so tests and CI fail on it instead of skipping.

Configuration (environment, read at load): ``FUSEDSERVE_NATIVE=0`` turns the native
kernels off; ``FUSEDSERVE_CPU_ISA=<a build above>|avxvnni_evex|scalar`` builds a
lower instruction set than the CPU's best (tests and benchmarks compare them).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"

# What each build needs from /proc/cpuinfo's flags, and the compiler flags it gets; the first
# whose needs the CPU meets is its best build.
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]
_AVX512_NEEDS = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"}
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
ISA_FLAGS: dict[str, tuple[set[str], list[str]]] = {
    # Sapphire Rapids and later, Zen 4/5: bf16 dot products and 512-bit VNNI.
    "avx512bf16": (_AVX512_NEEDS | {"avx512_bf16", "avx512_vnni"},
                   [*_AVX512, "-mavx512bf16", "-mavx512vnni"]),
    # Cascade Lake, Ice Lake: 512-bit VNNI for the int8 and int4 GEMMs, FMA for 16-bit.
    "avx512vnni": (_AVX512_NEEDS | {"avx512_vnni"}, [*_AVX512, "-mavx512vnni"]),
    "avx512": (_AVX512_NEEDS, _AVX512),
    # Alder Lake and later clients, Sierra Forest: 256-bit VNNI (VEX) without AVX-512.
    "avxvnni": ({"avx2", "fma", "f16c", "avx_vnni"}, [*_AVX2, "-mavxvnni"]),
    "avx2": ({"avx2", "fma", "f16c"}, _AVX2),
    "scalar": (set(), []),
    # The avxvnni build's code with its vpdpbusd in EVEX encoding (AVX-512 VNNI + VL) instead of
    # VEX: the same instruction on the same ymm registers, so hosts with AVX-512 VNNI but not
    # AVX-VNNI (Zen 4, Ice Lake) run and test the 256-bit VNNI kernels. Never a host's best.
    "avxvnni_evex": ({"avx2", "fma", "f16c", "avx512_vnni", "avx512vl"}, [*_AVX2, "-DFS_VNNI256_EVEX"]),
}
TEST_ONLY = frozenset({"avxvnni_evex"})


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be had here by design: no compiler or ninja, turned off, or an
    instruction set this CPU lacks."""


class NativeBuildError(NativeUnavailable):
    """A compiler is present but the build failed: a bug to fix, never a machine to skip."""


def missing_toolchain() -> str | None:
    """What this machine lacks to build the kernels (a C++ compiler, ninja), or None."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH)"
    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError as exc:
        return f"ninja is not installed ({exc})"
    return None


def cpu_flags() -> set[str]:
    """The running CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    return set(_cpuinfo_fields().get("flags", "").split())


def _cpuinfo_fields() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty off Linux)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    """The running CPU's model name (Linux /proc/cpuinfo; ``platform.processor()`` elsewhere)."""
    return _cpuinfo_fields().get("model name") or platform.processor() or "unknown CPU"


def cpu_generation() -> str:
    """Vendor, family, model and stepping: what tells CPUs apart where a hypervisor shows one
    model name for several (a VM's "AMD EPYC" is Zen 4 at family 25, Zen 5 at family 26)."""
    f = _cpuinfo_fields()
    if "cpu family" not in f:
        return platform.machine() or "unknown"
    return (f"{f.get('vendor_id', '?')} family {f['cpu family']} model {f.get('model', '?')} "
            f"stepping {f.get('stepping', '?')}")


def best_isa(flags: set[str]) -> str:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "scalar"
    for isa, (needs, _) in ISA_FLAGS.items():
        if needs <= flags and isa not in TEST_ONLY:
            return isa
    return "scalar"


def chosen_isa() -> str:
    """The instruction set to build: the CPU's best, or ``FUSEDSERVE_CPU_ISA`` if it runs here."""
    flags = cpu_flags()
    want = os.environ.get("FUSEDSERVE_CPU_ISA", "").strip().lower()
    if not want:
        return best_isa(flags)
    if want not in ISA_FLAGS:
        raise NativeUnavailable(f"FUSEDSERVE_CPU_ISA={want!r}: use one of {sorted(ISA_FLAGS)}")
    missing = ISA_FLAGS[want][0] - flags
    if missing and want != "scalar":
        raise NativeUnavailable(f"FUSEDSERVE_CPU_ISA={want}: this CPU lacks {sorted(missing)}")
    return want


def enabled() -> bool:
    return os.environ.get("FUSEDSERVE_NATIVE", "1").strip().lower() not in ("0", "off", "false", "no")


STALE_LOCK_S = 600.0  # a build takes about 30 s on 2 cores: a lock this old outlived its build


def clear_stale_lock(build_dir: Path, max_age_s: float = STALE_LOCK_S, now: float | None = None) -> bool:
    """Remove torch's build lock (``build_dir/lock``) when it is older than ``max_age_s``.

    The lock is a bare file: a process killed while building leaves it behind, and every later
    build of the same kernels waits on it forever (every worker hangs at start). True if one
    was removed (with a warning)."""
    lock = build_dir / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < max_age_s:
        return False
    log.warning("removing %s, left %.0f s ago by a build that did not finish (a killed process)", lock, age)
    lock.unlink(missing_ok=True)
    return True


def staged_sources(csrc: Path) -> Path:
    """``csrc`` copied once into a folder named for its content, beside torch's builds.

    The build's commands name their sources by path, so building from ``csrc`` itself rebuilt
    everything for every checkout (and every ``ray job`` working directory) of the same sources;
    built from the content's own folder, a second checkout finds the first one's build."""
    from torch.utils import cpp_extension

    files = sorted(p for p in csrc.iterdir() if p.suffix in (".cpp", ".h"))
    digest = hashlib.sha1()
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    staged = root / f"fusedserve_src_{digest.hexdigest()[:16]}"
    if not staged.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".fusedserve_src_", dir=root))
        for f in files:
            shutil.copy2(f, tmp / f.name)
        try:
            tmp.rename(staged)  # atomic: a concurrent stager's identical copy may have won
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return staged


def is_built(isa: str, name: str = "fusedserve_cpu") -> bool:
    """Whether a build of ``isa`` is in torch's cache already (loading it then takes seconds)."""
    from torch.utils import cpp_extension

    try:
        folder = Path(cpp_extension._get_build_directory(f"{name}_{isa}", False))
    except (AttributeError, OSError):
        return False
    return any(folder.glob(f"{name}_{isa}*.so"))


@functools.cache
def build(isa: str, csrc: Path = CSRC, name: str = "fusedserve_cpu") -> ModuleType:
    """Compile (or load from the cache) the kernels for ``isa`` from ``csrc``.

    Raises NativeUnavailable where the toolchain is missing, NativeBuildError where it is
    present and the build fails."""
    from torch.utils import cpp_extension

    _, mflags = ISA_FLAGS[isa]
    missing = missing_toolchain()
    if missing is not None:
        raise NativeUnavailable(missing)
    fresh = not is_built(isa, name)
    if fresh:
        log.warning("building the native CPU kernels for %s (first run on this machine only: about 30 s "
                    "on 2 cores) ...", isa)
    started = time.monotonic()
    src = staged_sources(csrc)
    sources = sorted(str(p) for p in src.glob("*.cpp"))
    # torch rebuilds when a source or a flag changes, not a header: the header's hash is a flag.
    header = hashlib.sha1((src / "kernels.h").read_bytes()).hexdigest()[:12]
    try:
        clear_stale_lock(Path(cpp_extension._get_build_directory(f"{name}_{isa}", False)))
    except (AttributeError, OSError):  # a torch without the helper: its own lock handling only
        pass
    try:
        module = cpp_extension.load(
            name=f"{name}_{isa}",
            sources=sources,
            extra_cflags=["-O3", "-fopenmp", *mflags, f"-DFUSEDSERVE_HEADER={header}"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as exc:
        raise NativeBuildError(f"building the native kernels for {isa} failed: {exc}") from None
    took = time.monotonic() - started
    if fresh or took > 10:
        log.warning("native CPU kernels for %s ready in %.0f s", isa, took)
    return module


@functools.cache
def kernels() -> ModuleType | None:
    """The native kernel module for this CPU, or None (with one warning) if it cannot be had."""
    if not enabled():
        log.info("native CPU kernels are off (FUSEDSERVE_NATIVE=0): using ATen's")
        return None
    try:
        return build(chosen_isa())
    except NativeBuildError as exc:
        log.error("native CPU kernels failed to build with a compiler present, using ATen's: %s", exc)
        return None
    except NativeUnavailable as exc:
        log.warning("native CPU kernels unavailable, using ATen's: %s", exc)
        return None


def expected() -> bool:
    """Whether the native kernels will run here, answered without building or loading them (what
    config resolution may ask in the coordinator): on, a toolchain present, the ISA available."""
    if not enabled() or missing_toolchain() is not None:
        return False
    try:
        chosen_isa()
    except NativeUnavailable:
        return False
    return True


def require() -> ModuleType | None:
    """The native build, or None only where it is off or the toolchain is missing by design; a
    build that fails with a compiler present raises (tests and CI fail instead of skipping)."""
    if not enabled() or missing_toolchain() is not None:
        return None
    return build(chosen_isa())
