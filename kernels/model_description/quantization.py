"""The weight quantizations a model may run with: what the CLI offers and config resolution checks
(the arithmetic is ``kernels/quantize.py``'s, on the worker)."""

from __future__ import annotations

# The weight quantizations a worker applies at load (int8 and int4 multiply with int8 activations on
# the native CPU kernels; int8-weight-only keeps them 16-bit). "none" or None: the checkpoint's.
QUANTIZATIONS = ("int8", "int8-weight-only", "int4")


def check_quantization(mode: str | None) -> str | None:
    """The mode as the model takes it (None for none); ValueError naming the choices otherwise."""
    if mode in (None, "none"):
        return None
    if mode == "fp8":  # vLLM's: resolved against the checkpoint (coordinator/engine/config_resolution.py)
        return mode
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be none, fp8, {', '.join(QUANTIZATIONS)}; got {mode!r}")
    return mode
