#!/usr/bin/env bash
# One device call's command per wheel part (bench/gpu_wheels.sh): every CUDA path of Podium and
# the GPU benchmarks, in four calls back to back on one warm device machine. Logs go to $OUT.
#
#   device run carry=[".gpuwheels/part-a"] command="bash bench/gpu_run.sh a"   # ~6 min
#   device run carry=[".gpuwheels/part-b"] command="bash bench/gpu_run.sh b"   # ~5 min
#   device run carry=[".gpuwheels/part-c"] command="bash bench/gpu_run.sh c"   # seconds
#   device run carry=[".gpuwheels/part-d"] command="bash bench/gpu_run.sh d"   # ~9 min
#
# a: installs Podium's missing imports and its entry points (the registered env, algorithm and
#    generator names) into /tmp/site; the `gpu` tests; each algorithm's preset
#    trained on cuda through `podium train` (PPO with two fused learners too). b: the rule's
#    CUDA rows for large populations (bench/compiled_rows.py).
# d: MuJoCo Warp's Ant and Humanoid (bench/gpu_physics.py). Each step has its own time limit, so
# one that hangs leaves the others' results.
#
#   device run carry=[".gpuwheels/part-a"] command="bash bench/gpu_run.sh quick"  # ~5 min
#   device run carry=[".gpuwheels/compiled"] command="bash bench/gpu_run.sh compiled"  # ~9 min
#
# quick: what a 15-minute lease affords in one call: part a's install, the `gpu` tests, two fused
#    learners on cuda, and a tournament of GPU pods end to end (`podium run` on the embedded
#    platform, examples/pendulum.yaml with one GPU per pod: the orchestrator gives the pod the GPU
#    through CUDA_VISIBLE_DEVICES and PODIUM_GPUS, the pod trains on cuda, the updater ranks it),
#    then the same with population pods of 16 agents (`pop` runs that alone).
# compiled: the compiled iteration's GPU rows (`bench/gpu_wheels.sh compiled` makes its wheels):
#    every `gpu` test (the CUDA graphs against eager), PureJaxRL against Podium compiled and eager
#    on PureJaxRL's CartPole and Pendulum recipes at P = 1, 64, 1,024 (bench/purejaxrl_peer.py),
#    and the rule's CUDA rows (bench/compiled_rows.py).
set -uo pipefail
stage=$1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
py=python3
pip_install() { $py -m pip install -q --no-index --no-deps --no-compile --no-build-isolation --target /tmp/site "$@"; }
step() {  # step NAME SECONDS COMMAND...: run with a time limit, its output to $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date +%T), limit ${limit}s): $*"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "== $name: exit $? after $SECONDS s in this call"
    tail -n 12 "$OUT/$name.log"
}
install_a() {  # install_a [PART]: a wheel part (part-a unless named) and Podium's entry points
    local part=.gpuwheels/${1:-part-a}
    pip_install "$part"/*.whl || exit 1
    cp -r "$part"/podium-*.dist-info /tmp/site/
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,temperature.gpu --format=csv
    $py -c "import torch; print(torch.__version__, torch.cuda.get_device_name(), torch.version.cuda)"
}
gpu_tests() {
    step gpu_tests 240 $py -m pytest -m gpu -p no:cacheprovider -q -rs tests/pod/test_compiled.py \
        tests/pod/envs/test_env_protocol.py tests/pod/test_fusion.py
}
fused_learners() {  # two learners fused on one GPU (gloo)
    step train-ppo-fused2 90 $py -m services.cli train Pendulum-v1 --set device=cuda \
        --set learners=2 --quiet --out /tmp/train/fused2
}
# examples/pendulum.yaml with one GPU per pod through `podium run` (the embedded platform), extra
# sed expressions applied to the spec; then which device each pod trained on, from its log lines.
gpu_tournament() {
    local name=$1
    shift
    sed -e 's/^  gpus: 0$/  gpus: 1/' "$@" examples/pendulum.yaml >"/tmp/$name.yaml"
    grep -q '^  gpus: 1$' "/tmp/$name.yaml" || exit 1
    step "$name" 200 $py -m services.cli run "/tmp/$name.yaml" --out "/tmp/$name" --timeout 180
    grep -h -o '"device": *"[a-z:0-9]*"' /tmp/"$name"/data/experiments/*/pods/*.log | sort | uniq -c
}
# A population pod of 16 agents (shared network shape, so update_epochs fixed, gSDE off).
POPULATION=(-e 's/^  max_pods: 4$/  max_pods: 4\n  agents_per_pod: 16/' -e '/^  update_epochs:/d'
    -e 's/^search_space:$/search_space:\n  sde_sample_freq: {type: choice, values: [0]}/')
case $stage in
compiled)
    install_a compiled
    step gpu_tests 150 $py -m pytest -m gpu -p no:cacheprovider -q -rs tests/pod/test_compiled.py \
        tests/pod/test_kstep.py tests/pod/envs/test_env_protocol.py tests/pod/test_fusion.py \
        tests/pod/test_gpu_check.py
    for recipe in cartpole pendulum; do
        step "peer_$recipe" 150 $py bench/purejaxrl_peer.py --device cuda --recipe "$recipe" \
            --agents 1 64 1024 --seeds 1 --steps 500000 --out "$OUT/peer_$recipe.json"
    done
    step rows 120 $py bench/compiled_rows.py --device cuda --steps 20 --cases \
        ppo:Pendulum-v1:1 ppo:Pendulum-v1:64 sac:Pendulum-v1:1 --out "$OUT/compiled_rows.json"
    ;;
pop)
    install_a
    gpu_tournament podium_run_gpu_pop "${POPULATION[@]}"
    ;;
quick)
    install_a
    gpu_tests
    fused_learners
    ls /dev/nvidia*  # the local backend counts GPUs by these device nodes
    gpu_tournament podium_run_gpu
    gpu_tournament podium_run_gpu_pop "${POPULATION[@]}"
    ;;
a)
    install_a
    gpu_tests
    for run in "ppo CartPole-v1" "dqn CartPole-v1" "ppo Pendulum-v1" "sac Pendulum-v1" \
        "td3 Pendulum-v1" "ddpg Pendulum-v1"; do
        set -- $run
        step "train-$1-$2" 90 $py -m services.cli train "$2" --set algorithm="$1" \
            --set device=cuda --quiet --out "/tmp/train/$1_$2"
    done
    fused_learners
    cat "$OUT"/train-*.log >"$OUT/train.log" && rm "$OUT"/train-*.log  # 8 files come back
    ;;
b)
    mkdir -p /tmp/w && cp .gpuwheels/part-b/* /tmp/w/
    step compiled_rows 280 $py bench/compiled_rows.py --device cuda --steps 20 --cases \
        ppo:CartPole-v1:1024 ppo:Pendulum-v1:1024 td3:Pendulum-v1:64 dqn:CartPole-v1:64
    ;;
c)  # the first part of warp's wheel (over one call's carry), for d
    mkdir -p /tmp/w && cp .gpuwheels/part-c/* /tmp/w/
    ;;
d)
    cp .gpuwheels/part-d/* /tmp/w/
    (cd /tmp/w && cat warp.whl.part-* >"$(cat warp.whl.name)" && rm warp.whl.part-*) || exit 1
    pip_install /tmp/w/*.whl || exit 1
    step gpu_physics 540 $py bench/gpu_physics.py --curve-seconds 240
    ;;
esac
