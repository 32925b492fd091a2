"""What a checkpoint's weights are stored as, read from ``config.json``'s ``quantization_config``,
and the quantization they run with.

- No ``quantization_config``: 16/32-bit tensors (``--quantization`` may quantize them at load).
- ``quant_method: "fp8"`` with ``weight_block_size`` (Qwen's FP8 releases, DeepSeek's layout):
  e4m3 weights, ``<name>_scale_inv`` one fp32 multiplier per block. Dequantized as they are read
  (``worker/model/loader.py``); on the CPU they then run as int8 W8A8, re-quantized per output
  channel from the dequantized values (the FP8 bytes per weight, the int8 kernels' speed); on an
  accelerator as the 16-bit dtype (no FP8 GEMM is wired yet).
- ``quant_method: "gguf"`` (written by ``coordinator/model_files/gguf_model.py`` beside a GGUF
  file): the weights are the file's tensors (``worker/model/gguf_tensors.py``); the file's type
  decides the quantization (Q4_0 and the other 4/5-bit types: int4, Q4_0 bit for bit; Q8_0 and
  Q6_K: int8; F16/BF16/F32: none), on accelerators int8 or none.
- ``quant_method: "awq"`` (AutoAWQ's GEMM layout, 4-bit, zero points) and ``"gptq"`` (4 or
  8 bits, ``desc_act`` by ``g_idx``): ``worker/model/group_quant.py``; 4-bit in-order groups run
  as int4 with zero points, bit for bit; ``desc_act`` and 8-bit as int8, re-quantized.
  Projections named by ``modules_to_not_convert`` or a GPTQ ``dynamic`` "-:" rule are read as
  16-bit tensors.
- Anything else is refused by name: a quantized checkpoint loaded as if it were 16-bit answers
  garbage without an error.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from fusedserve.kernels.model_description.config import ConfigError

SUPPORTED = ("16-bit safetensors, block-wise FP8 (quant_method 'fp8' with weight_block_size), AWQ (GEMM, "
             "4-bit), GPTQ (4/8-bit) and GGUF files")
GGUF_INT4 = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "IQ4_NL", "IQ4_XS")  # run as int4 on the CPU
GGUF_FLOAT = ("F32", "F16", "BF16")
FP8_QUANTIZATIONS = (None, "int8", "int8-weight-only")  # what an FP8 checkpoint may be asked to run as


@dataclass(frozen=True)
class GroupQuant:
    """An AWQ or GPTQ checkpoint's packing (``worker/model/group_quant.py`` unpacks it)."""

    method: str  # "awq" | "gptq"
    bits: int
    group_size: int  # -1: one group per row
    zero_offset: int = 0  # added to stored zero points (GPTQ v1: 1)
    desc_act: bool = False  # GPTQ: groups follow a permutation of the inputs (g_idx)
    # Projections stored unquantized: ``modules_to_not_convert`` (names containing one of these, as
    # transformers matches them) and GPTQModel's ``dynamic`` "-:" rules (regexes matched at the
    # start of the module's name). Qwen3.5's GPTQ releases keep their attention layers so.
    unconverted: tuple[str, ...] = ()
    unconverted_patterns: tuple[str, ...] = ()

    def converts(self, module: str) -> bool:
        """Whether projection ``module`` (its weight's name less ``.weight``) is stored packed."""
        return not (any(m in module for m in self.unconverted)
                    or any(re.match(p, module) for p in self.unconverted_patterns))

    @property
    def runs_as(self) -> str:
        """The CPU quantization these weights map onto: int4 where exact, else int8."""
        return "int4" if self.bits == 4 and not self.desc_act else "int8"

    def group_rows(self, in_features: int) -> int:
        return in_features if self.group_size <= 0 else self.group_size


@dataclass(frozen=True)
class CheckpointFormat:
    method: str | None = None  # None: 16/32-bit tensors; "fp8": block-wise e4m3; "gguf"
    block: tuple[int, int] | None = None  # fp8: the rows x columns one scale covers
    file: str | None = None  # gguf: the file
    weights: str | None = None  # gguf: the projections' most common type (Q4_0, Q8_0, F16, ...)
    group_quant: GroupQuant | None = None  # awq, gptq: bits, group size, zero-point convention

    def quantization(self, asked: str | None, device_kind: str) -> str | None:
        """The quantization these weights run with on ``device_kind``, given ``--quantization``
        (already checked by ``check_quantization``); one the format cannot take is refused."""
        if self.method is None:
            return asked
        if self.method == "gguf":
            return self._gguf_quantization(asked, device_kind)
        if self.group_quant is not None:
            own = self.group_quant.runs_as if device_kind == "cpu" else "int8"
            bits = self.group_quant.bits
            return _own(asked, own, f"this {self.method.upper()} checkpoint ({bits}-bit: runs as {own})")
        if asked not in FP8_QUANTIZATIONS:
            raise ConfigError(f"--quantization {asked} conflicts with this FP8 checkpoint: its weights run "
                              "as int8 (re-quantized per channel from the FP8 blocks) or, on an accelerator, "
                              "16-bit; ask for none or int8")
        return asked or ("int8" if device_kind == "cpu" else None)

    def _gguf_quantization(self, asked: str | None, device_kind: str) -> str | None:
        if self.weights in GGUF_FLOAT:
            return asked  # 16-bit weights: quantized at load only if asked
        own = "int4" if self.weights in GGUF_INT4 and device_kind == "cpu" else "int8"
        return _own(asked, own, f"this GGUF file's {self.weights} weights (they run as {own})")

    def describe(self) -> str:
        if self.method is None:
            return "16-bit"
        if self.method == "gguf":
            return f"gguf {self.weights} ({self.file})"
        if self.group_quant is not None:
            g = self.group_quant
            return f"{g.method} {g.bits}-bit, group {g.group_size}"
        return f"fp8 e4m3, scale blocks {self.block[0]}x{self.block[1]}"


PLAIN = CheckpointFormat()  # 16/32-bit tensors


def _own(asked: str | None, own: str, what: str) -> str:
    """A quantized checkpoint runs as ``own``: asking for nothing or for it (int8 also as
    int8-weight-only) is taken, anything else refused."""
    if asked in (None, own) or (own == "int8" and asked == "int8-weight-only"):
        return asked or own
    raise ConfigError(f"--quantization {asked} conflicts with {what}; ask for none or {own}")


def checkpoint_format(model_dir: str | Path) -> CheckpointFormat:
    """The format ``model_dir/config.json`` declares; ConfigError for one this loader cannot read."""
    path = Path(model_dir) / "config.json"
    try:
        qc = json.loads(path.read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError) as exc:
        raise ConfigError(f"{path}: unreadable config: {exc}") from None
    if not qc:
        return PLAIN
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method == "fp8":
        block = qc.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2
                and all(isinstance(b, int) and b > 0 for b in block)):
            raise ConfigError(f"{path}: FP8 without weight_block_size (per-tensor or per-channel scales) is "
                              f"not supported; supported: {SUPPORTED}")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"{path}: FP8 format {qc.get('fmt')!r} is not supported (e4m3 only)")
        return CheckpointFormat("fp8", (block[0], block[1]))
    if method == "gguf" and isinstance(qc.get("file"), str) and isinstance(qc.get("weights"), str):
        return CheckpointFormat("gguf", file=qc["file"], weights=qc["weights"])
    if method in ("awq", "gptq"):
        return CheckpointFormat(method, group_quant=_group_quant(path, method, qc))
    raise ConfigError(f"{path}: quantization_config.quant_method {method!r} is not supported; this loader "
                      f"reads {SUPPORTED}. Loading it as 16-bit would answer garbage.")


def _group_quant(path: Path, method: str, qc: dict) -> GroupQuant:
    bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size", 128))
    if not isinstance(group, int) or group == 0 or group < -1:
        raise ConfigError(f"{path}: {method} group_size {group!r} is not supported")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm" or not qc.get("zero_point", True):
            raise ConfigError(f"{path}: AWQ {bits}-bit {version!r} (zero_point {qc.get('zero_point')}) is "
                              "not supported; AutoAWQ's 4-bit GEMM layout with zero points is")
        return GroupQuant("awq", 4, group, unconverted=_unconverted(path, qc))
    fmt = qc.get("checkpoint_format", "gptq")
    if bits not in (4, 8) or fmt not in ("gptq", "gptq_v2"):
        raise ConfigError(f"{path}: GPTQ {bits}-bit, checkpoint_format {fmt!r} is not supported; 4 or 8 bits "
                          "in the gptq or gptq_v2 layout are")
    patterns = []
    for key, override in (qc.get("dynamic") or {}).items():
        if key.startswith("-:"):
            patterns.append(key[2:])
        elif override and any(override.get(f, v) != v for f, v in (("bits", bits), ("group_size", group))):
            raise ConfigError(f"{path}: GPTQ dynamic rule {key!r} overrides {override}; per-module bits and "
                              "group sizes are not supported (only '-:' rules, modules left unquantized)")
    return GroupQuant("gptq", bits, group, zero_offset=1 if fmt == "gptq" else 0,
                      desc_act=bool(qc.get("desc_act", False)), unconverted=_unconverted(path, qc),
                      unconverted_patterns=tuple(patterns))


def _unconverted(path: Path, qc: dict) -> tuple[str, ...]:
    names = qc.get("modules_to_not_convert") or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{path}: quantization_config.modules_to_not_convert must be a list of names")
    return tuple(names)


def parameter_count(model_dir: str) -> int:
    """Parameters of the checkpoint, read from its safetensors headers or its GGUF file's tensor
    list (no tensor is loaded); packed AWQ/GPTQ words count as the weights they hold, their scales
    and zero points not at all."""
    from safetensors import safe_open

    fmt = checkpoint_format(model_dir)
    if fmt.method == "gguf":
        import gguf

        return sum(int(t.n_elements) for t in gguf.GGUFReader(fmt.file, "r").tensors)
    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                n = math.prod(f.get_slice(name).get_shape())
                if fmt.group_quant is not None and name.endswith(".qweight"):
                    n *= 32 // fmt.group_quant.bits
                elif fmt.group_quant is not None and name.endswith((".qzeros", ".scales", ".g_idx")):
                    n = 0
                elif name.endswith("_scale_inv"):  # FP8 block scales
                    n = 0
                total += n
    return total
