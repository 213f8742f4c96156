#!/usr/bin/env bash
# One device call's command per wheel part (bench/gpu_wheels.sh): every CUDA path of Podium and
# the GPU benchmarks, in four calls back to back on one warm device machine. Logs go to $OUT.
#
#   device run carry=[".gpuwheels/part-a"] command="bash bench/gpu_run.sh a"   # ~6 min
#   device run carry=[".gpuwheels/part-b"] command="bash bench/gpu_run.sh b"   # ~5 min
#   device run carry=[".gpuwheels/part-c"] command="bash bench/gpu_run.sh c"   # ~4 min
#   device run carry=[".gpuwheels/part-d"] command="bash bench/gpu_run.sh d"   # ~9 min
#
# a: installs Podium's missing imports and its entry points (the registered env, algorithm and
#    generator names) into /tmp/site; the `gpu` tests; each algorithm's preset
#    trained on cuda through `podium train` (PPO with two fused learners too); the batched
#    population against a loop of agents. b: the compiled loop against eager on cuda, up to 4M
#    envs. c: the pod's roles fused vs three processes on cuda (CUDA tensors between processes).
# d: MuJoCo Warp's Ant and Humanoid (bench/gpu_physics.py). Each step has its own time limit, so
# one that hangs leaves the others' results.
#
#   device run carry=[".gpuwheels/part-a"] command="bash bench/gpu_run.sh quick"  # ~5 min
#   device run carry=[".gpuwheels/anakin"] command="bash bench/gpu_run.sh anakin"  # ~8 min
#   device run carry=[".gpuwheels/anakin"] command="bash bench/gpu_run.sh anakin-check"  # ~4 min
#
# quick: what a 15-minute lease affords in one call: part a's install, the `gpu` tests, two fused
#    learners on cuda, and a tournament of GPU pods end to end (`podium run` on the embedded
#    platform, examples/pendulum.yaml with one GPU per pod: the orchestrator gives the pod the GPU
#    through CUDA_VISIBLE_DEVICES and PODIUM_GPUS, the pod trains on cuda, the updater ranks it),
#    then the same with population pods of 16 agents (`pop` runs that alone).
# anakin: the Anakin trainer's GPU rows (`bench/gpu_wheels.sh anakin` makes its wheels): the CUDA-graph
#    check, PureJaxRL against Podium at P = 1, 64, 1,024 and the large batch (bench/gpu_rows.py);
#    the Anakin trainer as a pod runs it (bench/anakin_trainer_rows.py); `podium train` on
#    PureJaxRL's recipe from start to 5e5 env steps.
# anakin-check: that `podium train` again, with its metrics.jsonl (fit's clock per iteration),
#    then every `gpu` test. (py-spy sampling it there fell 70 s behind: no profile.)
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
        tests/pod/envs/test_env_protocol.py tests/pod/test_multiprocess.py tests/pod/test_fusion.py
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
anakin)
    install_a anakin
    step gpu_rows 280 $py bench/gpu_rows.py --rows check peer large
    step trainer_rows 140 $py bench/anakin_trainer_rows.py --device cuda --recipes purejaxrl \
        cartpole-pod --agents 1 64 --iterations 20
    step train_recipe 80 bash -c "time $py -m services.cli train CartPole-v1 --config \
        bench/configs/purejaxrl_cartpole.yaml --set device=cuda --quiet --out /tmp/train/recipe"
    ;;
anakin-check)
    install_a anakin
    step train_recipe 100 bash -c "time $py -m services.cli train CartPole-v1 --config \
        bench/configs/purejaxrl_cartpole.yaml --set device=cuda --quiet --out /tmp/train/recipe"
    cp /tmp/train/recipe/metrics.jsonl "$OUT/"
    step gpu_tests 170 $py -m pytest -m gpu -p no:cacheprovider -q -rs tests/pod/test_anakin.py \
        tests/pod/test_kstep.py tests/pod/test_compiled.py tests/pod/envs/test_env_protocol.py \
        tests/pod/test_fusion.py tests/pod/test_gpu_check.py tests/pod/test_portfolio_trainer.py \
        tests/pod/test_multiprocess.py
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
    step population 150 $py bench/population_vmap.py --device cuda --sizes 1 32 128 \
        --hidden 64 256 --seeds 3 --repeats 3
    cat "$OUT"/train-*.log >"$OUT/train.log" && rm "$OUT"/train-*.log  # 8 files come back
    ;;
b)
    mkdir -p /tmp/w && cp .gpuwheels/part-b/* /tmp/w/
    step compiled_loop 280 $py bench/compiled_loop.py --device cuda --envs CartPole-v1 \
        Pendulum-v1 --counts 4096 65536 1048576 4194304 --seconds 0.3 --repeats 3
    ;;
c)
    cp .gpuwheels/part-c/* /tmp/w/
    step pod_modes 220 $py bench/pod_modes.py --device cuda --envs Pendulum-v1 CartPole-v1 \
        --num-envs 4096 --seeds 2 --updates 50 --modes fused processes
    ;;
d)
    cp .gpuwheels/part-d/* /tmp/w/
    (cd /tmp/w && cat warp.whl.part-* >"$(cat warp.whl.name)" && rm warp.whl.part-*) || exit 1
    pip_install /tmp/w/*.whl || exit 1
    step gpu_physics 540 $py bench/gpu_physics.py --curve-seconds 240
    ;;
esac
