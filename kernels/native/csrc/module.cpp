// The Python module: kernels/native.py builds it once per instruction set.
// pybind11 and torch's Tensor casters alone: <torch/extension.h> pulls in the whole C++ frontend
// (21 s of compile here against 9 s).
#include <torch/csrc/utils/pybind.h>

#include "kernels.h"

namespace {

const char* isa_name() {
#if defined(__AVX512BF16__)
  return "avx512bf16";
#elif defined(__AVX512VNNI__)
  return "avx512vnni";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(FS_VNNI256_EVEX)
  return "avxvnni_evex";
#elif defined(__AVXVNNI__)
  return "avxvnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

using namespace fusedserve;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa_name, "the instruction set this build targets");
  m.attr("VL") = fusedserve::VL;  // floats per vector: the prompt rule takes head dims in these
  m.def("has_packed", &has_packed, "whether linear_packed exists in this build");
#if defined(__AVX512BF16__)
  m.def("linear_packed", &linear_packed, "out = x @ W.T, W packed [N/16, K/2, 16, 2] (bf16 or int8 + scales)",
        py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("out"));
#endif
  m.def("brgemm_block", &brgemm_block, "columns per block of the brgemm packs");
  m.def("linear_brgemm", &linear_brgemm,
        "out = x @ W.T by oneDNN's brgemm micro-kernel (AMX where present), W [N/64, K/2, 64, 2] bf16",
        py::arg("x"), py::arg("packed"), py::arg("out"));
  m.def("linear_brgemm_w8a8", &linear_brgemm_w8a8,
        "acc = q @ W.T exactly (int32) by oneDNN's brgemm, u8 x s8, W [N/64, K/4, 64, 4] int8",
        py::arg("q"), py::arg("packed"), py::arg("wsum"), py::arg("acc"));
  m.def("vector_lanes", &vector_lanes, "fp32 lanes of this build's vectors (the FMA pack's width)");
  m.def("linear_fma", &linear_fma, "out = x @ W.T, W packed [N/VL, K, VL] (bf16, fp16 or fp32), fp32 FMA",
        py::arg("x"), py::arg("packed"), py::arg("out"));
  m.def("int8_lanes", &int8_lanes, "int32 lanes of the W8A8 pack (0: no vector unit)");
  m.def("int8_offset", &int8_offset, "whether W8A8 stores activations + 128 (VNNI)");
  m.def("linear_w8a8", &linear_w8a8, "out = quantize(x) @ W.T, W int8 packed [N/VI, K/4, VI, 4], int32 sums",
        py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("wsum"), py::arg("out"));
  m.def("quantize_rows_i8", &quantize_rows_i8, "q, sx = rows of x as linear_w8a8 quantizes them (signed)",
        py::arg("x"), py::arg("q"), py::arg("sx"));
  m.def("scale_int32", &scale_int32, "out = acc * sx[:, None] * sw[None, :], as linear_w8a8 scales its sums",
        py::arg("acc"), py::arg("sx"), py::arg("sw"), py::arg("out"));
  m.def("int4_lanes", &int4_lanes, "int32 lanes of the W4A8 pack (0: no vector unit)");
  m.def("linear_w4a8", &linear_w4a8,
        "out = quantize(x) @ W.T, W 4-bit in groups of 32, fp16 group scales, zero points 8 or given",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("out"), py::arg("zeros") = py::none());
  m.def("linear", &linear, "out = x @ w.T (x scale for int8 w), fp32 accumulation",
        py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("out"));
  m.def("decode_attention", &decode_attention, "paged decode attention, K/V read in place (bf16/fp16/fp32 or int8 rows + scale)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("block_size"), py::arg("scale"), py::arg("out"));
  m.def("has_prompt_attention", &has_prompt_attention, "whether prompt_attention runs in this build");
  m.def("prompt_attention", &prompt_attention,
        "prompt chunks' causal attention over the paged bf16 or int8 cache, flash style (vdpbf16ps)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("chunks"),
        py::arg("block_size"), py::arg("scale"), py::arg("out"));
  m.def("add_rms_norm", &add_rms_norm, "x += add; out = rms_norm(x) * w (rows)",
        py::arg("x"), py::arg("add"), py::arg("w"), py::arg("eps"), py::arg("out"));
  m.def("qk_norm_rope", &qk_norm_rope,
        "per-head q/k RMSNorm and rotary, q into q_out, k in place; k and v into their cache slots",
        py::arg("qkv"), py::arg("q_w"), py::arg("k_w"), py::arg("cos"), py::arg("sin"), py::arg("eps"),
        py::arg("q_out"), py::arg("heads"), py::arg("kv_heads"), py::arg("k_cache") = py::none(),
        py::arg("v_cache") = py::none(), py::arg("slot_mapping") = py::none());
  m.def("lora_apply", &lora_apply,
        "y[t] += B_s A_s x[t] for each token t of slot s = slots[t] (active slots), part j of y's columns "
        "expanded from u's columns j * rank ..", py::arg("x"), py::arg("y"), py::arg("slots"), py::arg("a"),
        py::arg("bt"), py::arg("parts"), py::arg("active"));
  m.def("silu_mul", &silu_mul, "out = silu(gate) * up for gate_up = [gate, up]", py::arg("gate_up"),
        py::arg("out"));
  m.def("gated_delta_step", &gated_delta_step,
        "a decode step after the conv: q/k norms, beta and g, the delta rule in place in each row's slot, "
        "the gated RMSNorm of its output",
        py::arg("conv"), py::arg("b"), py::arg("a"), py::arg("z"), py::arg("neg_a"), py::arg("dt_bias"),
        py::arg("norm_w"), py::arg("eps"), py::arg("key_heads"), py::arg("state"), py::arg("slots"),
        py::arg("out"));
  m.def("conv_decode", &conv_decode, "SiLU(causal conv) of one new input per row; its slot's inputs shift",
        py::arg("x"), py::arg("state"), py::arg("slots"), py::arg("weight"), py::arg("out"));
  m.def("gated_delta_prompt", &gated_delta_prompt,
        "one sequence's prompt chunk after the conv: the chunked delta rule from its slot's state, in place, "
        "and the gated RMSNorm of its output",
        py::arg("conv"), py::arg("b"), py::arg("a"), py::arg("z"), py::arg("neg_a"), py::arg("dt_bias"),
        py::arg("norm_w"), py::arg("eps"), py::arg("key_heads"), py::arg("state"), py::arg("slots"), py::arg("row"),
        py::arg("out"));
  m.def("conv_prompt", &conv_prompt, "SiLU(causal conv) of one sequence's new inputs from its slot's; the slot keeps the last",
        py::arg("x"), py::arg("state"), py::arg("slots"), py::arg("row"), py::arg("weight"), py::arg("out"));
  m.def("group_arrive_wait", &group_arrive_wait,
        "publish this rank's seq, wait (GIL released) until every rank's flag reaches it; false after wait_us",
        py::arg("flags"), py::arg("rank"), py::arg("seq"), py::arg("wait_us"),
        py::call_guard<py::gil_scoped_release>());
  m.def("apply_token_bitmask", &apply_token_bitmask, "logits[b, v] = -inf where bit v of bitmask[b] is 0",
        py::arg("logits"), py::arg("bitmask"));
}

