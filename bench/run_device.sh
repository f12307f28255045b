#!/usr/bin/env bash
# Run benchmark stages on the GPU machine, each logged; results and logs land in $OUT.
#   bash bench/run_device.sh STAGE [ARGS...]; STAGE: env | forward | generate | profile | parallel |
#   decoders | flags | compile | memory | sparse | serve | train | gputests, or kernels.NAME | probes.NAME
#   (bench/kernels, bench/probes). gputests: the kernel tests on the GPU (the tests marked
#   "needs a GPU" run there), their log kept as gputests.log with the results.
# serve installs the wheels of .whl/ first (bench/wheels.sh; carry .whl).
# DJAX_COMMIT names the commit being measured (the device copy has no .git).
set -uo pipefail
export PYTHONUNBUFFERED=1
export DJAX_COMPILE_CACHE="${DJAX_COMPILE_CACHE:-$PWD/.cache/xla}"
stage=$1
shift
log="$OUT/${stage}.log"
case "$stage" in
  env)
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
      python3 -c "import jax, flax, orbax.checkpoint as o, transformers, optax; print(jax.__version__, jax.devices(), flax.__version__, transformers.__version__)"
    } 2>&1 | tee "$log" ;;
  forward | generate | profile | parallel | decoders | flags | compile | memory | sparse | kernels.* | probes.*)
    python3 -m "bench.$stage" "$@" 2>&1 | tee "$log" ;;
  serve)
    if [ -d .whl ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit
      export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    python3 -m bench.serve "$@" 2>&1 | tee "$log" ;;
  gputests)
    python3 -m pytest -q -rs -p no:cacheprovider tests/kernels tests/test_kernel_choice.py \
      tests/test_llada.py tests/test_llada_moe.py "$@" 2>&1 | tee "$log" ;;
  train)
    python3 -m djax.demo.train "$@" 2>&1 | tee "$log" ;;
  *)
    echo "unknown stage $stage" >&2; exit 2 ;;
esac
