"""Every checkpoint format fusedserve reads, written from the embedded trained model, and the
error of each as served: top-1 agreement and max |logit error| at 50 positions of held-out text
against transformers in fp32 on (a) the format's own dequantized weights (the kernel's error)
and (b) the original bf16 checkpoint (the format's whole error), with the bytes on disk.

The writers are the tests' (``tests/model/test_checkpoint_formats.py``, ``tests/model/test_group_quant.py``,
``tests/model/test_gguf.py``): FP8 as Qwen writes it, AWQ and GPTQ as AutoAWQ and GPTQ pack, GGUF
with the ``gguf`` package's writer. With ``--llama-cpp DIR`` (a build, ``benchmarks/llama_cpp.py``),
llama.cpp's ``llama-quantize`` also makes Q4_K_M and Q6_K files from the F16 one: the K-quants
fusedserve dequantizes and re-quantizes (the ``gguf`` writer cannot make them).

    python -m fusedserve.benchmarks.weight_formats [--llama-cpp DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from fusedserve.coordinator.model_files.default_model import TRAINED_DIR, resolve_model
from fusedserve.kernels.model_description.checkpoint_format import checkpoint_format
from fusedserve.worker.model.qwen3 import Qwen3Model
from tests.model.test_checkpoint_formats import _tensors, write_dequantized, write_fp8
from tests.model.test_gguf import write_gguf
from tests.model.test_group_quant import write_group_quant
from tests.model.test_quantization import _last_logits, agreement, heldout_positions, hf_logits


def _gguf_dequantized(path: Path, out: Path) -> Path:
    """A GGUF file's weights as fp32 safetensors under Hugging Face names (fusedserve's own read)."""
    from fusedserve.worker.model.gguf_tensors import GGUFTensors

    t = GGUFTensors(path)
    names = [n for n in _tensors(TRAINED_DIR) if t.has(n)]
    return write_dequantized(TRAINED_DIR, out, {n: t.read(n) for n in names})


def _size(p: Path) -> int:
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.glob("*.safetensors"))


def measure(llama_dir: str | None = None) -> dict:
    ids, ends = heldout_positions()
    original = hf_logits(TRAINED_DIR, ids, ends)
    rows = {}
    saved = os.environ.get("FUSEDSERVE_CACHE")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            os.environ["FUSEDSERVE_CACHE"] = str(root / "cache")  # the GGUF sidecars go with the files
            made: dict[str, tuple[Path, Path, int]] = {}  # name: (served path, dequantized dir, bytes)

            made["bf16 (none)"] = (TRAINED_DIR, TRAINED_DIR, _size(TRAINED_DIR))
            deq = write_fp8(TRAINED_DIR, root / "fp8")
            made["fp8 block 128x128"] = (root / "fp8", write_dequantized(TRAINED_DIR, root / "fp8-deq", deq),
                                         _size(root / "fp8"))
            for name, args in (("awq 4-bit g128", ("awq", 4, False, False)),
                               ("gptq 4-bit g128 sym", ("gptq", 4, True, False)),
                               ("gptq 4-bit g128 desc_act", ("gptq", 4, False, True)),
                               ("gptq 8-bit g128", ("gptq", 8, False, False))):
                method, bits, sym, act = args
                out = root / name.replace(" ", "_")
                d = write_group_quant(TRAINED_DIR, out, method, bits, sym=sym, desc_act=act)
                deq_dir = write_dequantized(TRAINED_DIR, out.with_name(out.name + "-deq"), d)
                made[name] = (out, deq_dir, _size(out))
            for q in ("F16", "Q8_0", "Q4_0"):
                path = write_gguf(TRAINED_DIR, root / f"model-{q}.gguf", q)
                made[f"gguf {q}"] = (path, _gguf_dequantized(path, root / f"gguf-{q}-deq"), _size(path))
            for q in ("Q4_K_M", "Q6_K") if llama_dir else ():
                path = root / f"model-{q}.gguf"
                tool = Path(llama_dir) / "build" / "bin" / "llama-quantize"
                subprocess.run([str(tool), str(root / "model-F16.gguf"), str(path), q], check=True,
                               capture_output=True, timeout=600)
                deq_dir = _gguf_dequantized(path, root / f"gguf-{q}-deq")
                made[f"gguf {q} (llama-quantize)"] = (path, deq_dir, _size(path))
            for name, (path, deq_dir, nbytes) in made.items():
                model_dir = resolve_model(str(path))
                model = Qwen3Model.from_pretrained(model_dir, dtype="bfloat16")
                got = _last_logits(model, [ids[:e] for e in ends])
                own = hf_logits(deq_dir, ids, ends)
                kernel_top1, kernel_err = agreement(got, own)
                total_top1, total_err = agreement(got, original)
                rows[name] = {
                    "runs_as": f"{model.quantization or 'bf16'} ({model.kernel_info()['linear']})",
                    "format": checkpoint_format(model_dir).describe().split(" (")[0],
                    "bytes": nbytes,
                    "kernel_top1": kernel_top1, "kernel_max_err": kernel_err,
                    "total_top1": total_top1, "total_max_err": total_err,
                }

    finally:
        if saved is None:
            os.environ.pop("FUSEDSERVE_CACHE", None)
        else:
            os.environ["FUSEDSERVE_CACHE"] = saved
    return {"model": "embedded trained (4 layers, hidden 256)", "positions": len(ends), "rows": rows}


def table(res: dict) -> list[str]:
    lines = [f"Model: {res['model']}; {res['positions']} positions of held-out text; transformers fp32 as "
             "the reference.", "",
             "| checkpoint | runs as | MB on disk | vs its own dequantized weights: top-1 / max abs err "
             "| vs the bf16 original: top-1 / max abs err |", "|---|---|---|---|---|"]
    for name, r in res["rows"].items():
        lines.append(f"| {name} | {r['runs_as']} | {r['bytes'] / 1e6:.1f} | {100 * r['kernel_top1']:.0f}% / "
                     f"{r['kernel_max_err']:.3f} | {100 * r['total_top1']:.0f}% / {r['total_max_err']:.3f} |")
    return lines


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--llama-cpp", default=None, help="a built llama.cpp folder: adds Q4_K_M and Q6_K files")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = measure(args.llama_cpp)
    print("\n".join(table(res)))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
