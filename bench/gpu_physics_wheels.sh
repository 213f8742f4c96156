#!/usr/bin/env bash
# Wheels for bench/gpu_physics.py on the device machine (Python 3.12, torch preinstalled, no
# network there), cut into parts that fit one device call's 64 MiB carry each.
#
#   bench/gpu_physics_wheels.sh            # here: fills .gpuwheels/part-{a,b,c}/ (in .gitignore)
#
# Then three device calls back to back (the machine stays warm 30 s after a call, and ignored
# paths it already has are kept between calls), each carrying one part:
#   run carry=[".gpuwheels/part-a"]  command: mkdir -p /tmp/w && cp .gpuwheels/part-a/* /tmp/w/
#   run carry=[".gpuwheels/part-b"]  command: cp .gpuwheels/part-b/* /tmp/w/
#   run carry=[".gpuwheels/part-c"]  command: cp .gpuwheels/part-c/* /tmp/w/ && cd /tmp/w &&
#       cat warp.whl.part-* > warp_lang-$WARP-py3-none-manylinux_2_28_x86_64.whl &&
#       rm warp.whl.part-* && cd - && python3 -m pip install -q --no-index --no-deps
#       --no-build-isolation --target /tmp/site /tmp/w/*.whl . &&
#       PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 bench/gpu_physics.py --parts physics ppo
# Installing Podium itself (the final ".") puts its entry points (the env names) in /tmp/site.
# The wheels are Podium's imports that the device image lacks (its torch, numpy, absl-py, etils,
# safetensors and typing-extensions are used as they are) plus Warp and MuJoCo; docs/gpu_physics.md.
set -euo pipefail
WARP=${WARP:-1.19.0}
MUJOCO=${MUJOCO:-4.0.0}
dir=.gpuwheels
rm -rf "$dir" && mkdir -p "$dir/dl" "$dir/part-a" "$dir/part-b" "$dir/part-c"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir/dl" "warp-lang==$WARP" "mujoco-warp==$MUJOCO" "mujoco==$MUJOCO" \
    "mujoco-core==$MUJOCO" "mujoco-studio==$MUJOCO" glfw pyopengl \
    gymnasium==1.4.0 farama-notifications==0.0.6 pydantic==2.14.3 pydantic-core==2.50.4 \
    annotated-types==0.8.0 typing-inspection==0.4.5
warp_whl=$(ls "$dir"/dl/warp_lang-*.whl)
split -b 55m -d "$warp_whl" "$dir/dl/warp.whl.part-"
rm "$warp_whl"
mv "$dir"/dl/warp.whl.part-00 "$dir"/dl/gymnasium-*.whl "$dir"/dl/farama*.whl \
    "$dir"/dl/pydantic*.whl "$dir"/dl/annotated*.whl "$dir"/dl/typing_inspection*.whl "$dir/part-a/"
mv "$dir"/dl/warp.whl.part-01 "$dir/part-b/"
mv "$dir"/dl/warp.whl.part-* "$dir"/dl/*.whl "$dir/part-c/"
rmdir "$dir/dl"
du -sh "$dir"/part-*
