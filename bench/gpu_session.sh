#!/usr/bin/env bash
# Everything prl measures on a GPU, in one or more calls of the lent GPU (~15 device minutes a session, at most 10
# minutes a call):
#   the packed-attention kernels, the chunked logprob head (eager and fused) and the grouped MoE experts against
#   the paths they replace (checked, then timed),
#   the trainer's step (tokens/s, MFU, peak memory) with packed attention, with transformers' dense-mask sdpa,
#   with activation checkpointing, with LoRA adapters (rank 16; the MoE's on its experts too), with compiled
#   blocks and logprob head (trainer.compile), and compiled with float8 linear layers (trainer.precision: fp8,
#   against the compiled bf16 run before it).
#
#   bash bench/gpu_session.sh [PART ...]     # the named parts, in the order given; none: every part
#
# Every part in order takes up to the sum of the bounds below, more than one call may run: name the parts to
# split a session into calls (the parts not measured on a GPU yet come first). Each part has its own time
# bound; a part that fails does not stop the next. Output: one log per part under $OUT (or ./gpu-out).
#
# The lent machine's image has torch and transformers but not msgspec or omegaconf, and an older transformers
# than ours: carry them as wheels in .whl/ (see /work/.library/device/README.md; list in docs/testing.md;
# torchao for the fp8 part).
set -u
# name, bound in seconds, command
parts=(
    "kernels 150 python3 bench/gpu_kernels.py"
    "trainer_compile 150 python3 bench/gpu_trainer.py --tokens 16384 --compile"
    "trainer_fp8 150 python3 bench/gpu_trainer.py --tokens 16384 --compile --precision fp8"
    "trainer 200 python3 bench/gpu_trainer.py --tokens 16384 32768"
    "trainer_sdpa 90 python3 bench/gpu_trainer.py --tokens 16384 --attention sdpa"
    "trainer_ac 90 python3 bench/gpu_trainer.py --tokens 65536 --models dense --ac"
    "trainer_lora 90 python3 bench/gpu_trainer.py --tokens 16384 --lora 16 --lora-experts"
)
declare -A spec
names=()
for p in "${parts[@]}"; do names+=("${p%% *}"); spec[${p%% *}]=$p; done
wanted=("$@")
[ ${#wanted[@]} -gt 0 ] || wanted=("${names[@]}")
for w in "${wanted[@]}"; do
    if [ -z "$w" ] || [ -z "${spec[$w]+set}" ]; then
        echo "gpu_session.sh: no part named '$w' (parts: ${names[*]})" >&2
        exit 2
    fi
done
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$out/machine.txt"
part() {  # part NAME SECONDS ARGS...: one bounded step, its output teed into $out/NAME.txt
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most $limit s): $*"
    local t0=$SECONDS
    timeout "$limit" "$@" > >(tee "$out/$name.txt") 2>&1
    echo "== $name: exit $? after $((SECONDS - t0)) s"
}
for w in "${wanted[@]}"; do
    read -r -a args <<< "${spec[$w]}"
    part "${args[@]}"
done
