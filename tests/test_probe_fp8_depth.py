"""`bench.probes.fp8_depth`'s three weight streams: the weight as drawn, its fp8 rounding
(djax's per-output-channel rule, back in bf16) and relative noise of that rounding's size."""

import jax
import jax.numpy as jnp
import numpy as np

from bench.probes import fp8_depth
from djax.models import fp8


def test_streams_are_the_weight_its_rounding_and_matched_noise():
    w = fp8_depth._weight(jax.random.key(1), (512, 256))
    (plain, rounded, noisy), eps = fp8_depth._streams(w, jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(plain, np.float32), np.asarray(w, np.float32))
    values, scale = fp8.quantize(w, (0,))
    want = fp8.dequantize(values, scale, (0,), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(rounded, np.float32), np.asarray(want, np.float32))
    wf = np.asarray(w, np.float32)

    def relative(a):
        return np.linalg.norm(np.asarray(a, np.float32) - wf) / np.linalg.norm(wf)

    assert 0.02 < float(eps) < 0.03  # e4m3's 3-bit mantissa on N(0, 0.02) values
    assert abs(relative(rounded) - float(eps)) < 2e-3  # bf16 rounding of the rounded values
    assert abs(relative(noisy) / float(eps) - 1) < 0.05  # noise of the rounding's size
