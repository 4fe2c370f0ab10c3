"""Quantization methods: how a projection's weights are created, loaded and multiplied (vLLM's split of a
QuantizationConfig, which picks a method per layer, from the LinearMethod that owns the layer's weights).

A `QuantizableLinear` (engine/parallel_layers.py; `layer` below) asks the method of the model being built for
everything about its weight: `create_weights` makes its parameters, `load_weight` puts a checkpoint tensor's rows of one part (q, k or v;
gate or up) in place, `process_weights_after_loading` turns what was loaded into the layout the matmul reads (a
oneDNN-packed bf16 copy, int8 groups...), and `apply` is the matmul. linear_method.py holds that protocol and
picks the method of a `QuantizationConfig` (config.py: what a checkpoint's `quantization_config` says, or the
weight-only method an engine config asks for). One method per module:

- unquantized.py: the checkpoint's float weights, torch's matmul (oneDNN-packed for bf16 on CPU): today's path.
- gguf.py: a GGUF file's quantized blocks kept as they are, multiplied by conveyor_kernels/quantized_matmul.
- weight_only.py: int8 / int4 groups quantized at load time from a float checkpoint, the same kernels.
- w4a16.py: an AWQ or GPTQ checkpoint's 4-bit groups with zero points, repacked 4-bit for the CPU kernels or the
  Triton W4A16 GEMM (conveyor_kernels/w4a16_matmul.py).
- fp8.py: an FP8 checkpoint's float8 weights (per-tensor / per-channel scales), W8A8 by torch._scaled_mm on CUDA,
  dequantized on the fly elsewhere.

Checkpoints that store a projection as several tensors (AWQ / GPTQ's qweight, qzeros, scales; FP8's weight and
weight_scale) are gathered into one tensor per projection by the method's `wrap_checkpoint`, which
engine/loader.py applies to the checkpoint's tensors.

Embeddings, norms, MoE experts and routers stay unquantized: a quantized checkpoint tensor headed there is
dequantized (exactly) as it is loaded.
"""
