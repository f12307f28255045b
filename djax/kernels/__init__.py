"""djax's hand-written kernels: each module takes and returns JAX arrays (or the hand-offs
of `handoff`) and imports only jax, numpy and its sibling modules, never a model or its
config. All are Pallas Mosaic GPU kernels for Hopper GPUs (TMA copies, WGMMA). Off GPUs
every kernel runs in Mosaic GPU's interpreter, which is how the CPU tests check them.

- `flash_attention_mosaic`: split-K/V attention of a window against the K/V buffers.
- `split_k_mosaic`: a split-K product for few rows, its partial sums left to the consumer.
- `swiglu_mosaic`: the SwiGLU gate/up product with the activation fused, for few rows.
- `residual_product_mosaic`: a product with the residual add and the next norm's inputs
  fused.
- `residual_norm_mosaic`: the residual add and RMSNorm between a layer's blocks, per row or
  column-tiled after a split-K product (leaving the norm to the next product).
- `rope_write_mosaic`: q/k norm, RoPE and the K/V buffer writes, in the q/k/v product's
  epilogue or on a product made elsewhere.
- `tma_ring`: the TMA/WGMMA ring and tile rules every kernel shares.
- `expert_tiles_mosaic`: the routed experts' products, tiled per expert, for 16-bit or fp8
  weights (values and scales given apart).
- `fp8_matmul_mosaic`: the product of few rows quantised to e4m3 and an e4m3 weight stored
  [n, k], by fp8 x fp8 WGMMA in Pallas Mosaic GPU (Hopper), and its SwiGLU form.
- `handoff`: what the kernels hand each other (`Partials`, `ScaledRows`).
"""
