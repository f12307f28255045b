"""djax's hand-written kernels: each module takes and returns JAX arrays (or the hand-offs
of `handoff`) and imports only jax, numpy and its sibling modules, never a model or its
config. Off GPUs every kernel runs in Pallas's interpreter (Mosaic GPU's for the Mosaic GPU
kernels), which is how the CPU tests check them.

- `flash_attention`: split-K/V attention of a window against the K/V buffers;
  `flash_attention_mosaic`: the same in Pallas Mosaic GPU (Hopper).
- `swiglu`: the SwiGLU gate/up product with the activation fused, for few rows.
- `split_k`: a split-K product for few rows, its partial sums left to the consumer.
- `split_k_mosaic`, `swiglu_mosaic`, `residual_product_mosaic`: the split-K, SwiGLU and
  residual products in Pallas Mosaic GPU (Hopper), with the same contracts; `tma_ring`:
  the TMA/WGMMA ring and tile rules every Mosaic GPU kernel shares.
- `residual_norm`: the residual add and RMSNorm between a layer's blocks;
  `residual_norm_mosaic`: its tiled add and per-row norm in Pallas Mosaic GPU.
- `residual_product`: a product with the residual add and the next norm's inputs fused.
- `rope_write`: q/k norm, RoPE and the K/V buffer writes (with the q/k/v product fused);
  `rope_write_mosaic`: the same in Pallas Mosaic GPU, in the q/k/v product's epilogue.
- `expert_tiles`: the routed experts' products, tiled per expert; `expert_tiles_mosaic`: the
  same in Pallas Mosaic GPU, also for fp8 weights (values and scales given apart).
- `fp8_matmul_mosaic`: the product of few rows quantised to e4m3 and an e4m3 weight stored
  [n, k], by fp8 x fp8 WGMMA in Pallas Mosaic GPU (Hopper), and its SwiGLU form.
- `handoff`: what the kernels hand each other (`Partials`, `ScaledRows`).
- `tiles`: tile rules shared by the kernels.
"""
