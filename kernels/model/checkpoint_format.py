"""What a checkpoint's weights are stored as, read from ``config.json``'s ``quantization_config``,
and the quantization they run with.

- No ``quantization_config``: 16/32-bit tensors (``--quantization`` may quantize them at load).
- ``quant_method: "fp8"`` with ``weight_block_size`` (Qwen's FP8 releases, DeepSeek's layout):
  e4m3 weights, ``<name>_scale_inv`` one fp32 multiplier per block. Dequantized as they are read
  (``kernels/model/loader.py``); on the CPU they then run as int8 W8A8, re-quantized per output
  channel from the dequantized values (the FP8 bytes per weight, the int8 kernels' speed); on an
  accelerator as the 16-bit dtype (no FP8 GEMM is wired yet).
- Anything else is refused by name: a quantized checkpoint loaded as if it were 16-bit answers
  garbage without an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kernels.model.config import ConfigError

SUPPORTED = "16-bit safetensors, and block-wise FP8 (quant_method 'fp8' with weight_block_size)"
FP8_QUANTIZATIONS = (None, "int8", "int8-weight-only")  # what an FP8 checkpoint may be asked to run as


@dataclass(frozen=True)
class CheckpointFormat:
    method: str | None = None  # None: 16/32-bit tensors; "fp8": block-wise e4m3
    block: tuple[int, int] | None = None  # fp8: the rows x columns one scale covers

    def quantization(self, asked: str | None, device_kind: str) -> str | None:
        """The quantization these weights run with on ``device_kind``, given ``--quantization``
        (already checked by ``check_quantization``); one the format cannot take is refused."""
        if self.method is None:
            return asked
        if asked not in FP8_QUANTIZATIONS:
            raise ConfigError(f"--quantization {asked} conflicts with this FP8 checkpoint: its weights run "
                              "as int8 (re-quantized per channel from the FP8 blocks) or, on an accelerator, "
                              "16-bit; ask for none or int8")
        return asked or ("int8" if device_kind == "cpu" else None)

    def describe(self) -> str:
        if self.method is None:
            return "16-bit"
        return f"fp8 e4m3, scale blocks {self.block[0]}x{self.block[1]}"


PLAIN = CheckpointFormat()  # 16/32-bit tensors


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
    raise ConfigError(f"{path}: quantization_config.quant_method {method!r} is not supported; this loader "
                      f"reads {SUPPORTED}. Loading it as 16-bit would answer garbage.")
