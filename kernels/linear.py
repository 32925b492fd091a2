"""The matmul of every projection, chosen once per model from the device and the weights.

A weight is a 16/32-bit tensor ``[out, in]``, an ``Int8Weight`` (int8, per-output-channel
scales), an ``Int4Weight`` (4-bit, an fp16 scale per group of 32 inputs), or a ``PackedWeight``:
one of those packed once at load into the layout of the native GEMM that runs it (bf16 pairs,
FMA panels, W8A8 or W4A8). On the CPU the native kernels (``kernels/native/build.py``) run every
weight but fp32, int8 and int4 with int8 activations quantized per token unless the model keeps
them 16-bit (``int8-weight-only``); fp32 weights and CPUs without the native build use ATen. CUDA
and Ascend use their vendor int8 ops. Every path writes into the caller's ``out``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType

import torch

from fusedserve.kernels.host_memory import on_huge_pages
from fusedserve.kernels.native.gemm_choice import HEAD_ROWS, MODES, NATIVE, ROW_BUCKETS, GemmChooser, bucket
from fusedserve.kernels.quantize import INT4_GROUP, quantize_int4, quantize_int8

log = logging.getLogger(__name__)


@dataclass
class Int8Weight:
    """``w ~= q * scale[:, None]``; ``scale_act`` is ``scale`` in the activations' dtype
    (what ATen's and the vendors' int8 matmuls take); ``q_t`` is ``q.T`` where an op wants
    [in, out] (Ascend)."""

    q: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out] float32
    scale_act: torch.Tensor  # [out], activation dtype
    q_t: torch.Tensor | None = None

    @classmethod
    def quantize(cls, w: torch.Tensor, act_dtype: torch.dtype, device: torch.device) -> Int8Weight:
        q, scale = quantize_int8(w)
        q, scale = q.to(device), scale.to(device)
        q_t = q.t().contiguous() if device.type == "npu" else None
        return cls(q, scale, scale.to(act_dtype), q_t)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


@dataclass
class Int4Weight:
    """``w ~= (u - z) * d`` per group of 32 inputs, before packing: ``z`` 8 (symmetric,
    ``kernels/quantize.py``, Q4_0) or a zero point per group (AWQ, GPTQ)."""

    u: torch.Tensor  # [out, G * 32] uint8 in [0, 15]
    d: torch.Tensor  # [out, G] float16
    in_features: int
    z: torch.Tensor | None = None  # [out, G] uint8 in [0, 15]; None: 8

    @classmethod
    def quantize(cls, w: torch.Tensor, device: torch.device) -> Int4Weight:
        u, d = quantize_int4(w)
        return cls(u.to(device), d.to(device), w.shape[1])

    @property
    def shape(self) -> tuple[int, int]:
        return (self.u.shape[0], self.in_features)


@dataclass
class PackedWeight:
    """A weight in a native packed GEMM's layout, packed once at load:

    - ``pairs`` (AVX-512 BF16): bf16 or int8 as ``[ceil(out/16), in/2, 16, 2]``, one 64-byte
      vector = 16 output channels x one pair of inputs (``vdpbf16ps``);
    - ``fma`` (AVX2, AVX-512 without BF16): bf16 or fp16 as ``[ceil(out/VL), in, VL]``, one
      vector = VL output channels of one input, converted to fp32 once per row tile.
    """

    packed: torch.Tensor
    scale: torch.Tensor | None  # [out] float32 for int8
    out_features: int
    in_features: int
    layout: str = "pairs"
    wsum: torch.Tensor | None = None  # w8a8: [out] int32, each row's sum of int8 weights
    zeros: torch.Tensor | None = None  # w4a8 with zero points: uint8, shaped as ``scale``
    # The same weight for the matrix-engine paths, each kept only where its path won a row bucket
    # (``kernels/native/gemm_choice.py``): ``matrix`` [out, in] as oneDNN's matmul takes it (bf16, or
    # int8 with ``scale``); ``brgemm`` in the brgemm micro-kernel's VNNI blocks of 64 columns
    # (``kernels/native/csrc/brgemm.cpp``). ``paths[bucket(rows)]``: which path runs a launch.
    matrix: torch.Tensor | None = None
    brgemm: torch.Tensor | None = None
    paths: tuple[str, ...] = ()

    @classmethod
    def pack(cls, w: Weight) -> PackedWeight:
        q, scale = (w.q, w.scale) if isinstance(w, Int8Weight) else (w, None)
        n, k = q.shape
        return cls(_pad_rows(q, 16).view(-1, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous(), scale, n, k)

    @classmethod
    def pack_w8a8(cls, w: Int8Weight, lanes: int) -> PackedWeight:
        """``w8a8`` (int8 activations): int8 as ``[ceil(out/VI), ceil(in/4), VI, 4]``, one vector =
        VI output channels x 4 consecutive inputs, inputs padded with zeros to a multiple of 4."""
        q = w.q
        n, k = q.shape
        if k % 4:
            q = torch.cat([q, q.new_zeros(n, 4 - k % 4)], 1)
        packed = _pad_rows(q, lanes).view(-1, lanes, q.shape[1] // 4, 4).permute(0, 2, 1, 3).contiguous()
        return cls(packed, w.scale, n, k, "w8a8", w.q.sum(1, dtype=torch.int32))

    @classmethod
    def pack_w4a8(cls, w: Int4Weight, lanes: int) -> PackedWeight:
        """``w4a8`` (int8 activations): ``[ceil(out/VI), G, 4, VI, 4]`` bytes, block b of a group
        holding inputs 8b..8b+3 in low and 8b+4..8b+7 in high nibbles; fp16 scales
        ``[ceil(out/VI), G, VI]`` in ``scale``."""
        n = w.u.shape[0]
        # [vectors, lanes, groups, block, half (low/high nibble), 4 inputs]
        u = _pad_rows(w.u, lanes).view(-1, lanes, w.u.shape[1] // INT4_GROUP, 4, 2, 4)
        nibbles = u[:, :, :, :, 0, :] | (u[:, :, :, :, 1, :] << 4)
        packed = nibbles.permute(0, 2, 3, 1, 4).contiguous()
        d = _pad_rows(w.d, lanes).view(-1, lanes, w.d.shape[1]).permute(0, 2, 1).contiguous()
        z = None
        if w.z is not None:
            z = _pad_rows(w.z, lanes).view(-1, lanes, w.z.shape[1]).permute(0, 2, 1).contiguous()
        return cls(packed, d, n, w.in_features, "w4a8", zeros=z)

    @classmethod
    def pack_fma(cls, w: torch.Tensor, lanes: int) -> PackedWeight:
        n, k = w.shape
        return cls(_pad_rows(w, lanes).view(-1, lanes, k).permute(0, 2, 1).contiguous(), None, n, k, "fma")

    @property
    def dtype(self) -> torch.dtype:
        return self.packed.dtype

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        extra = sum(t.nbytes for t in (self.scale, self.matrix, self.brgemm, self.zeros) if t is not None)
        return self.packed.nbytes + extra


Weight = torch.Tensor | Int8Weight | Int4Weight | PackedWeight


def _vnni_blocks(w: torch.Tensor, columns: int, per: int) -> torch.Tensor:
    """``w`` [out, in] as the brgemm micro-kernel's B: ``[ceil(out/columns), in/per, columns, per]``
    (per = 2 bf16 or 4 int8 inputs in one 32-bit lane), rows padded with zeros."""
    n, k = w.shape
    return _pad_rows(w, columns).view(-1, columns, k // per, per).permute(0, 2, 1, 3).contiguous()


def _pad_rows(w: torch.Tensor, multiple: int) -> torch.Tensor:
    n = w.shape[0]
    return w if n % multiple == 0 else torch.cat([w, w.new_zeros(multiple - n % multiple, w.shape[1])])


class LinearOp:
    """``out = x @ w.T`` for whichever kind of weight, through the kernel this device has."""

    def __init__(self, device: torch.device, native: ModuleType | None, act_dtype: torch.dtype,
                 int8_activations: bool = True, gemm: str = "auto"):
        if gemm not in MODES:
            raise ValueError(f"cpu gemm {gemm!r}: one of {', '.join(MODES)}")
        self.device = device
        self.native = native if device.type == "cpu" else None
        self.act_dtype = act_dtype
        # "auto": a matrix-engine GEMM where it measured faster on this host; "native": never.
        self.chooser = (GemmChooser(self.native.isa(), torch.get_num_threads())
                        if self.native is not None and gemm == "auto" else None)
        self.matrix_from: dict[str, int] = {}  # "path-kind" -> fewest rows a matrix path ran
        self._agreed: dict[tuple[str, str, int, int], bool] = {}  # _agrees per path, layout and shape
        self._xq = torch.empty(0, dtype=torch.int8)  # the matrix int8 path's scratch, grown once
        self._sx = torch.empty(0, dtype=torch.float32)
        self._acc = torch.empty(0, dtype=torch.int32)
        # int8 weights with int8 activations (per-token scales, integer dot products), where the
        # native build has a vector unit; else (or asked) weight-only: widened to 16/32 bits.
        self.int8_lanes = self.native.int8_lanes() if self.native is not None and int8_activations else 0
        self.int4 = self.native is not None and self.native.int4_lanes() > 0  # W4A8 runs here
        # The packed GEMMs: bf16 pairs on AVX-512 BF16 builds (bf16 activations); fp32 FMA over
        # converted 16-bit weights on the other vector builds.
        self.packs = self.native is not None and self.native.has_packed() and act_dtype == torch.bfloat16
        self.lanes = self.native.vector_lanes() if self.native is not None else 1
        # Probed once, before any graph capture could hit a missing op: ATen's int8 matmul, or
        # dequantizing per call where this build lacks it for the device and dtype.
        self.int8_op = "native" if self.native is not None else _probe_int8(device, act_dtype)

    def prepare(self, w: Weight, max_rows: int = ROW_BUCKETS[-1]) -> Weight:
        """The weight in the layout its kernel reads (packed where a packed GEMM runs it), with a
        matrix-engine copy where that GEMM measured faster at some bucket up to ``max_rows``;
        packed weights on huge pages (``kernels/host_memory.py``: a step streams them all)."""
        p = self._prepare(w, max_rows)
        if isinstance(p, PackedWeight):
            p.packed = on_huge_pages(p.packed)
        return p

    def _prepare(self, w: Weight, max_rows: int) -> Weight:
        if isinstance(w, Int8Weight) and self.int8_lanes:
            return self._with_matrix(PackedWeight.pack_w8a8(w, self.int8_lanes), w.q, max_rows)
        if isinstance(w, Int4Weight):
            return PackedWeight.pack_w4a8(w, self.native.int4_lanes())
        if self.packs and w.shape[1] % 2 == 0 and (isinstance(w, Int8Weight) or w.dtype == torch.bfloat16):
            packed = PackedWeight.pack(w)
            return packed if isinstance(w, Int8Weight) else self._with_matrix(packed, w, max_rows)
        if self._fma(w):  # AVX2 / AVX-512 without BF16: oneDNN has no fast 16-bit GEMM there either
            return PackedWeight.pack_fma(w, self.lanes)
        return w

    def prepare_head(self, w: Weight) -> Weight:
        """An lm_head: its launches carry at most the rows that need logits."""
        return self.prepare(w, HEAD_ROWS)

    def _with_matrix(self, p: PackedWeight, plain: torch.Tensor, max_rows: int) -> PackedWeight:
        """``p`` with copies of ``plain`` for the matrix-engine paths that measured faster at some
        bucket (int8 W8A8; a 16-bit weight in the activations' dtype): oneDNN's matmul takes it as
        is, the brgemm micro-kernel in its VNNI blocks (where K is a multiple of 2, int8: 4)."""
        if self.chooser is None or (p.layout != "w8a8" and plain.dtype != self.act_dtype):
            return p
        kind = "w8a8" if p.layout == "w8a8" else str(plain.dtype).removeprefix("torch.")
        p.matrix = plain.contiguous()
        paths: dict[str, object] = {NATIVE: lambda x, out: self(x, p, out, path=NATIVE),
                                    "onednn": lambda x, out: self(x, p, out, path="onednn")}
        per = 4 if p.layout == "w8a8" else 2
        if plain.dtype in (torch.bfloat16, torch.int8) and p.in_features % per == 0:
            p.brgemm = _vnni_blocks(plain, self.native.brgemm_block(), per)
            if self._agrees(p, "brgemm"):
                paths["brgemm"] = lambda x, out: self(x, p, out, path="brgemm")
        choice = self.chooser.choose(kind, p.in_features, p.out_features, max_rows, paths, self.act_dtype)
        p.paths = choice if any(c != NATIVE for c in choice) else ()
        for path in ("onednn", "brgemm"):
            if path in choice:
                first = ROW_BUCKETS[choice.index(path)]
                key = f"{path}-{kind}"
                self.matrix_from[key] = min(first, self.matrix_from.get(key, first))
        if "onednn" not in choice:
            p.matrix = None
        if "brgemm" not in choice:
            p.brgemm = None
        return p

    def _agrees(self, p: PackedWeight, path: str, rows: int = 37) -> bool:
        """Whether ``path`` computes what the native kernel does on this host, checked once per
        layout and shape at load (the 28 layers of a shape share the answer) on random rows: int8
        bit for bit, bf16 within the summation-order bound. A path whose layout this host's
        micro-kernel reads otherwise is left out, with a warning."""
        key = (path, p.layout, p.in_features, p.out_features)
        if key not in self._agreed:
            self._agreed[key] = self._check_agrees(p, path, rows)
        return self._agreed[key]

    def _check_agrees(self, p: PackedWeight, path: str, rows: int) -> bool:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(rows, p.in_features, generator=g).to(self.act_dtype)
        a = torch.empty(rows, p.out_features, dtype=self.act_dtype)
        b = torch.empty_like(a)
        self(x, p, a, path=NATIVE)
        try:
            self(x, p, b, path=path)
        except (RuntimeError, NotImplementedError) as exc:
            log.info("%s GEMM unavailable here (%s): the native kernel keeps its shapes", path, exc)
            return False
        if p.layout == "w8a8":
            ok = torch.equal(a, b)
        else:
            w_max = p.matrix.float().abs().max() if p.matrix is not None else 1.0
            bound = 1e-5 * p.in_features * x.float().abs().max() * w_max
            ulp = torch.maximum(a.float().abs(), b.float().abs()) * 2.0**-7
            ok = bool(((a.float() - b.float()).abs() <= bound + ulp).all())
        if not ok:
            log.warning("%s GEMM disagrees with the native kernel on this host (K=%d N=%d): not used",
                        path, p.in_features, p.out_features)
        return ok

    def _fma(self, w: Weight) -> bool:
        return (self.lanes > 1 and not self.packs and isinstance(w, torch.Tensor)
                and w.dtype in (torch.bfloat16, torch.float16))

    def describe(self, weight_dtype: torch.dtype | str) -> str:
        """Which kernel runs a weight of this kind (stats and the startup log), and from how many
        rows oneDNN's matrix GEMM takes over where it measured faster."""
        name = self._describe(weight_dtype)
        kind = {"int8": "w8a8", "int4": "w8a8"}.get(weight_dtype, str(weight_dtype).removeprefix("torch."))
        for path in ("onednn", "brgemm"):
            if f"{path}-{kind}" in self.matrix_from:
                name += f" + {path}-{kind} from {self.matrix_from[f'{path}-{kind}']} rows"
        return name

    def _describe(self, weight_dtype: torch.dtype | str) -> str:
        if self.native is not None and weight_dtype == "int8" and self.int8_lanes:
            return f"native-{self.native.isa()}-w8a8"
        weight_dtype = "int8" if weight_dtype == "int8-wo" else weight_dtype
        if weight_dtype == "int4":
            return f"native-{self.native.isa()}-w4a8 (lm_head w8a8)"
        if self.native is not None and weight_dtype != torch.float32:
            packed = "-packed" if self.packs and weight_dtype in ("int8", torch.bfloat16) else ""
            if self.lanes > 1 and not self.packs and weight_dtype in (torch.bfloat16, torch.float16):
                packed = "-packed-fma"
            return f"native-{self.native.isa()}{packed}"
        if weight_dtype == "int8":
            return {"int8pack": "aten-int8pack", "npu": "npu-weight-quant"}.get(self.int8_op, "dequantize")
        return "aten-mm"

    def __call__(self, x: torch.Tensor, w: Weight, out: torch.Tensor,
                 path: str | None = None) -> torch.Tensor:
        """``path``: force one (``native``, ``onednn``, ``brgemm``: the matrix paths where the
        weight has their copy); None: as measured for the launch's rows."""
        if isinstance(w, PackedWeight):
            if path is None:
                path = w.paths[bucket(x.shape[0])] if w.paths else NATIVE
            if path != NATIVE and self._matrix(x, w, out, path):
                return out
            if w.layout == "fma":
                self.native.linear_fma(x, w.packed, out)
            elif w.layout == "w8a8":
                self.native.linear_w8a8(x, w.packed, w.scale, w.wsum, out)
            elif w.layout == "w4a8":
                self.native.linear_w4a8(x, w.packed, w.scale, out, w.zeros)
            else:
                self.native.linear_packed(x, w.packed, w.scale, out)
            return out
        if isinstance(w, Int8Weight):
            return self._int8(x, w, out)
        if self.native is not None and w.dtype != torch.float32:
            self.native.linear(x, w, None, out)
            return out
        return torch.mm(x, w.t(), out=out)

    def _matrix(self, x: torch.Tensor, w: PackedWeight, out: torch.Tensor, path: str) -> bool:
        """``out = x @ w.T`` on a matrix-engine path (AMX where the CPU has it); False where it
        cannot run this call (dtypes), so the native kernel does. int8: quantized and scaled by
        the native kernel's own code around exact int32 sums (bit-equal to ``linear_w8a8``)."""
        if w.layout == "w8a8":
            m, k, n = x.shape[0], w.in_features, w.out_features
            if self._xq.numel() < m * k or self._acc.numel() < m * n or self._sx.numel() < m:
                self._grow(m * k, m * n, m)
            q, acc = self._xq[: m * k].view(m, k), self._acc[: m * n].view(m, n)
            self.native.quantize_rows_i8(x, q, self._sx)
            if path == "brgemm":
                self.native.linear_brgemm_w8a8(q, w.brgemm, w.wsum, acc)
            else:
                torch._int_mm(q, w.matrix.t(), out=acc)
            self.native.scale_int32(acc, self._sx, w.scale, out)
            return True
        if path == "brgemm":
            if x.dtype != torch.bfloat16 or not x.is_contiguous() or out.dtype not in (torch.bfloat16,
                                                                                      torch.float32):
                return False
            self.native.linear_brgemm(x, w.brgemm, out)
            return True
        if x.dtype != w.matrix.dtype or out.dtype != w.matrix.dtype:
            return False
        torch.mm(x, w.matrix.t(), out=out)
        return True

    def _grow(self, xq: int, acc: int, rows: int) -> None:
        """The int8 matrix path's scratch, doubled past what a launch needs (a few growths at
        warm-up, none per step after)."""
        if self._xq.numel() < xq:
            self._xq = torch.empty(max(xq, 2 * self._xq.numel()), dtype=torch.int8)
        if self._acc.numel() < acc:
            self._acc = torch.empty(max(acc, 2 * self._acc.numel()), dtype=torch.int32)
        if self._sx.numel() < rows:
            self._sx = torch.empty(max(rows, 2 * self._sx.numel()), dtype=torch.float32)

    def _int8(self, x: torch.Tensor, w: Int8Weight, out: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            self.native.linear(x, w.q, w.scale, out)
            return out
        if self.int8_op == "npu":  # pragma: no cover - needs Ascend hardware
            import torch_npu

            out.copy_(torch_npu.npu_weight_quant_batchmatmul(x, w.q_t, w.scale_act))
        elif self.int8_op == "int8pack":
            out.copy_(torch._weight_int8pack_mm(x, w.q, w.scale_act))
        else:
            torch.mm(x, (w.q.to(x.dtype) * w.scale_act[:, None]).t(), out=out)
        return out


def _probe_int8(device: torch.device, dtype: torch.dtype) -> str:
    """Which int8 matmul this device and build run: ``npu``, ``int8pack`` or ``dequantize``."""
    if device.type == "npu":
        return "npu"
    x = torch.ones(1, 64, dtype=dtype, device=device)
    q = torch.ones(8, 64, dtype=torch.int8, device=device)
    try:
        torch._weight_int8pack_mm(x, q, torch.ones(8, dtype=dtype, device=device))
        return "int8pack"
    except (RuntimeError, NotImplementedError) as exc:
        log.warning("int8 matmul unavailable on %s for %s (%s): int8 weights are dequantized per call",
                    device, dtype, exc)
        return "dequantize"
