#!/usr/bin/env bash
# Run benchmark stages on the GPU machine, each logged; results and logs land in $OUT.
#   bash bench/run_device.sh STAGE [ARGS...]; STAGE: env | forward | generate | profile | parallel |
#   decoders | flags | compile | memory | sparse | load | fp8_error | fp8_accuracy | serve | train |
#   gputests | headlines | detach | collect,
#   or kernels.NAME | probes.NAME
#   (bench/kernels, bench/probes). gputests: the kernel tests on the GPU (the tests marked
#   "needs a GPU" run there), their log kept as gputests.log with the results. headlines: the
#   README's headline generations (LLaDA-8B bf16 and fp8 at batch 1 and 8, LLaDA-MoE spread
#   bf16 and fp8 at batch 1; medians of 3), into generate_fp8_<device>.json and
#   generate_spread_fp8_<device>.json: re-run it when the code under them changes.
# serve and gputests install the wheels of .whl/ first (bench/wheels.sh; carry .whl).
# Longer than one device command (10 minutes): `detach STAGE [ARGS...]` starts the stage in its
# own process session (it outlives the command while the machine stays held) with its results
# and logs in .cache/detached (or $DJAX_DETACHED), and returns; `collect SECONDS` waits up to
# SECONDS for it, then copies what it wrote so far into $OUT (detached.rc: its exit status,
# once it ended). The machine goes back when idle: detach and collect in one command, then
# collect again at once.
# DJAX_COMMIT names the commit being measured (the device copy has no .git).
set -uo pipefail
export PYTHONUNBUFFERED=1
export DJAX_COMPILE_CACHE="${DJAX_COMPILE_CACHE:-$PWD/.cache/xla}"
stage=$1
shift
# The wheels of .whl/ (bench/wheels.sh), where there are any, into /tmp/site.
install_wheels() {
  [ -d .whl ] || return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
}
log="$OUT/${stage}.log"
case "$stage" in
  env)
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
      python3 -c "import jax, flax, orbax.checkpoint as o, transformers, optax; print(jax.__version__, jax.devices(), flax.__version__, transformers.__version__)"
    } 2>&1 | tee "$log" ;;
  forward | generate | profile | parallel | decoders | flags | compile | memory | sparse | load | fp8_error | fp8_accuracy | kernels.* | probes.*)
    python3 -m "bench.$stage" "$@" 2>&1 | tee "$log" ;;
  serve)
    install_wheels || exit
    python3 -m bench.serve "$@" 2>&1 | tee "$log" ;;
  detach)
    detached="${DJAX_DETACHED:-$PWD/.cache/detached}"
    # Only a folder an earlier detach made (its marker inside) is emptied, and not while
    # that run goes on: a mistyped DJAX_DETACHED never loses anyone's files.
    if [ -e "$detached" ] && [ ! -f "$detached/.djax-detached" ]; then
      echo "$detached exists and is not a detach folder: give DJAX_DETACHED a new path" >&2
      exit 2
    fi
    if [ -f "$detached/.djax-detached" ] && [ ! -f "$detached/detached.rc" ]; then
      echo "a detached run is still going in $detached: collect it first" >&2
      exit 2
    fi
    rm -rf "$detached" && mkdir -p "$detached" && touch "$detached/.djax-detached"
    OUT="$detached" setsid nohup bash -c 'bash bench/run_device.sh "$@"; echo $? > "$OUT/detached.rc"' \
      run_device "$@" > "$detached/detached.log" 2>&1 < /dev/null &
    echo "detached $* (pid $!): bash bench/run_device.sh collect SECONDS" | tee "$log" ;;
  collect)
    detached="${DJAX_DETACHED:-$PWD/.cache/detached}"
    [ -d "$detached" ] || { echo "nothing detached" >&2; exit 2; }
    end=$((SECONDS + ${1:-0}))
    while [ ! -f "$detached/detached.rc" ] && [ $SECONDS -lt $end ]; do sleep 1; done
    cp -r "$detached"/. "$OUT"/
    if [ -f "$detached/detached.rc" ]; then echo "ended: rc $(cat "$detached/detached.rc")"
    else echo "still running after ${1:-0} s: collect again"; fi | tee "$log" ;;
  gputests)
    # With pytest-xdist among the wheels, 8 workers share the GPU (each allocating as it
    # goes): the Mosaic GPU kernels' compiles dominate, and they run on the CPUs.
    install_wheels || echo "wheels not installed: the tests run in one process" >&2
    workers=()
    if python3 -c "import xdist" 2>/dev/null; then
      workers=(-n 8)
      export XLA_PYTHON_CLIENT_PREALLOCATE=false
    fi
    # -v names every test as it ends, so a run cut short still says which failed.
    python3 -m pytest -v -rs -p no:cacheprovider "${workers[@]}" tests/kernels \
      tests/test_kernel_choice.py tests/test_fp8.py tests/test_fp8_mosaic.py \
      tests/test_llada.py tests/test_llada_moe.py tests/test_sparse_attention.py "$@" 2>&1 \
      | tee "$log" ;;
  headlines)
    setting=(--prompts 128 --caches dual --steps 64 --no-threshold --weights dtype fp8 --repeats 3)
    { python3 -m bench.generate --models dense --batch 1 8 "${setting[@]}" "$@" &&
      python3 -m bench.generate --models moe --routing spread --batch 1 "${setting[@]}" "$@"
    } 2>&1 | tee "$log" ;;
  train)
    python3 -m djax.demo.train "$@" 2>&1 | tee "$log" ;;
  *)
    echo "unknown stage $stage" >&2; exit 2 ;;
esac
