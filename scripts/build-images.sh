#!/usr/bin/env bash
# Build Podium's images on a machine that reaches only package registries (PyPI, Debian):
#   scripts/build-images.sh [TARGET...]     TARGETs: control-plane pod redis prometheus
#                                           (default: control-plane pod)
# - Docker engine: the one `docker info` reaches (DOCKER_HOST or the default socket); else, as
#   root, a private dockerd started here (own socket, data-root $PODIUM_DOCKER_ROOT outside the
#   clone so layers are reused between runs, --bridge=none --iptables=false: nothing changes on
#   the host's network) and stopped again, by its PID, when the script ends.
# - Base image: $PODIUM_BASE_IMAGE (default python:3.12-slim-bookworm) when present or pullable;
#   otherwise a stand-in made from Debian packages: debootstrap --variant=minbase bookworm,
#   `docker import`, then Debian's python3 + venv on top (deploy/images/python-base.Dockerfile).
#   redis and prometheus (docker-compose.offline.yml) are Debian's packages on the Debian base.
# - Python packages: with PODIUM_PIP_OFFLINE=1 (the default) the host's pip fills ./wheelhouse
#   (it reaches whatever indexes and proxies the host is configured for) and the build installs
#   from there with --no-index; PODIUM_PIP_OFFLINE=0 lets the build's pip go online (PyPI and
#   the PyTorch index; a proxy's CA certificate goes in wheelhouse/ca.pem).
# - What the builds leave: the classic builder keeps each build stage as an untagged image, the
#   layer cache of the next build; the `deps` and `pod-deps` stages (the venvs, ~0.7 and
#   ~1.65 GB) are tagged podium-build/<stage>:<tag> so that they are named, not "dangling".
#   Images this run replaced (the previous podium-*:<tag> and podium-build/*:<tag>) are removed;
#   with PODIUM_PRUNE_DANGLING=1 (the private engines of this script and the container tests,
#   whose data-root only Podium uses) every dangling image is. PODIUM_KEEP_BUILD_CACHE=0 drops
#   the stage images too (disk back; the next build installs everything again).
# Environment: PODIUM_IMAGE_TAG (default latest), PODIUM_TORCH_VERSION (2.13.0),
# PODIUM_TORCH_VARIANT (cpu), PODIUM_DOCKER_ROOT (/var/lib/podium-docker), DOCKER (docker).
# Prints one "[build-images] NAME: SIZE, built in Ns" line per image.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
tag="${PODIUM_IMAGE_TAG:-latest}"
base="${PODIUM_BASE_IMAGE:-python:3.12-slim-bookworm}"
debian="${PODIUM_DEBIAN_IMAGE:-debian:bookworm-slim}"
torch_version="${PODIUM_TORCH_VERSION:-2.13.0}"
torch_variant="${PODIUM_TORCH_VARIANT:-cpu}"
offline="${PODIUM_PIP_OFFLINE:-1}"
docker_root="${PODIUM_DOCKER_ROOT:-/var/lib/podium-docker}"
docker="${DOCKER:-docker}"
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(control-plane pod)
say() { echo "[build-images] $*" >&2; }

# ---- engine ------------------------------------------------------------------------------
dockerd_pid=""
run=""
stop_engine() {
  if [ -n "$dockerd_pid" ] && kill -0 "$dockerd_pid" 2>/dev/null; then
    say "stopping the private dockerd (pid $dockerd_pid)"
    kill -TERM "$dockerd_pid"
    for _ in $(seq 60); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.5; done
    # dockerd leaves the host network namespace bind-mounted in its exec-root; its containerd
    # may still be removing sockets: unmount, then try until the directory is gone.
    awk -v run="$run/" 'index($2, run) == 1 {print $2}' /proc/mounts | xargs -r umount
    for _ in $(seq 10); do rm -rf "$run" 2>/dev/null; [ -e "$run" ] || break; sleep 0.5; done
  fi
}
trap stop_engine EXIT
if ! "$docker" info >/dev/null 2>&1; then
  if [ "$(id -u)" != 0 ] || ! command -v dockerd >/dev/null; then
    say "no Docker engine answers and none can be started here (needs root and dockerd:" \
      "scripts/install-deploy-tools.sh installs docker.io as root)"
    exit 2
  fi
  run="/run/podium-docker-$$"
  mkdir -p "$run" "$docker_root"
  # One private engine per data-root at a time (a second run waits for the first).
  exec 9>"$docker_root.lock"
  flock 9
  export DOCKER_HOST="unix://$run/docker.sock"
  say "starting a private dockerd: $DOCKER_HOST, data-root $docker_root"
  dockerd --host "$DOCKER_HOST" --data-root "$docker_root" --exec-root "$run/exec" \
    --pidfile "$run/dockerd.pid" --bridge=none --iptables=false --ip6tables=false \
    >"$run/dockerd.log" 2>&1 &
  dockerd_pid=$!
  for _ in $(seq 120); do "$docker" info >/dev/null 2>&1 && break; sleep 0.5; done
  "$docker" info >/dev/null 2>&1 || { tail -20 "$run/dockerd.log" >&2; exit 1; }
  PODIUM_PRUNE_DANGLING=1  # our own engine and data-root: nobody else's images are there
fi

have() { "$docker" image inspect "$1" >/dev/null 2>&1; }
pullable() { have "$1" || timeout 60 "$docker" pull -q "$1" >/dev/null 2>&1; }

# ---- base images ---------------------------------------------------------------------------
debian_base() {
  pullable "$debian" && { echo "$debian"; return; }
  local standin=podium-base/debian:bookworm
  if ! have "$standin"; then
    command -v debootstrap >/dev/null || { say "cannot pull $debian and debootstrap is missing"; exit 2; }
    local rootfs
    rootfs="$(mktemp -d "${TMPDIR:-/tmp}/podium-rootfs.XXXXXX")"
    say "cannot pull $debian: making $standin with debootstrap (minbase bookworm)"
    debootstrap --variant=minbase bookworm "$rootfs" "${PODIUM_DEBIAN_MIRROR:-http://deb.debian.org/debian}" >&2
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | "$docker" import - "$standin" >/dev/null
    rm -rf "$rootfs"
  fi
  echo "$standin"
}
python_base() {
  pullable "$base" && { echo "$base"; return; }
  local standin=podium-base/python:bookworm
  if ! have "$standin"; then
    local deb
    deb="$(debian_base)"
    say "cannot pull $base: making $standin (Debian's python3 + venv on $deb)"
    "$docker" build -q --network host --build-arg "BASE_IMAGE=$deb" -t "$standin" \
      -f deploy/images/python-base.Dockerfile deploy/images >/dev/null
  fi
  echo "$standin"
}

# ---- wheelhouse ------------------------------------------------------------------------------
fill_wheelhouse() {  # $1: the base image (its Python version decides the wheels)
  local py pyver reqs stamp
  py="${PODIUM_VENV:-$root/.venv}/bin/python"
  [ -x "$py" ] || py=python3
  # The full version: requirement markers compare it (redis needs async-timeout below 3.11.3).
  pyver="$("$docker" run --rm --network none --entrypoint python3 "$1" -c 'import platform; print(platform.python_version())')"
  reqs="$(mktemp)"
  "$py" -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['pod']))" >"$reqs"
  echo "setuptools>=69" >>"$reqs"
  echo "torch==${torch_version}+${torch_variant}" >>"$reqs"
  stamp="wheelhouse/.filled-$pyver-$(sha256sum "$reqs" | cut -c1-16)"
  if [ -f "$stamp" ]; then rm -f "$reqs"; return; fi  # filled for exactly these requirements
  say "filling wheelhouse/ for Python $pyver with the host's pip"
  # pip's --python-version picks the wheel tags but not the version requirement markers see:
  # run the host's pip with the base's version in their place.
  "$py" - "$pyver" download -q --disable-pip-version-check --only-binary=:all: \
    --python-version "$pyver" -d wheelhouse -r "$reqs" >&2 <<'PY'
import platform
import sys

version = sys.argv.pop(1)
platform.python_version = lambda: version
from pip._internal.cli.main import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
PY
  rm -f "$reqs"
  touch "$stamp"
}

# ---- build -------------------------------------------------------------------------------
replaced=()  # ids of the images the names this run (re)tags pointed at before
remember() {  # $1: a name about to be (re)tagged
  local id
  if id="$("$docker" image inspect -f '{{.Id}}' "$1" 2>/dev/null)"; then replaced+=("$id"); fi
}
stage_leaves() {  # $1: a classic builder's log -> "stage id" per stage (BuildKit's log: none)
  awk '/^Step [0-9]+\/[0-9]+ : FROM .* [Aa][Ss] / { stage = $NF }
       /^ ---> [0-9a-f]+$/ && stage != "" { leaf[stage] = $2 }
       END { for (s in leaf) print s, leaf[s] }' "$1"
}
build() {  # $1: image name, rest: docker build arguments
  local name="$1" start log stage id
  shift
  start=$(date +%s)
  remember "$name"
  log="$(mktemp)"
  "$docker" build --network host -t "$name" "$@" 2>&1 | tee "$log" >&2
  say "$name: $("$docker" image inspect -f '{{.Size}}' "$name" | awk '{printf "%.0f MB", $1 / 1e6}'), built in $(($(date +%s) - start))s"
  # The venv stages, which only `COPY --from` reads: untagged, nothing would hold them.
  while read -r stage id; do
    case "$stage" in
      deps | pod-deps)
        remember "podium-build/$stage:$tag"
        "$docker" tag "$id" "podium-build/$stage:$tag"
        ;;
    esac
  done < <(stage_leaves "$log")
  rm -f "$log"
}
tidy() {  # leave no untagged image behind (see the header)
  local id before after
  before="$("$docker" images -q -f dangling=true | wc -l)"
  if [ "${PODIUM_KEEP_BUILD_CACHE:-1}" = 0 ]; then
    for stage in deps pod-deps; do
      if "$docker" image inspect "podium-build/$stage:$tag" >/dev/null 2>&1; then
        remember "podium-build/$stage:$tag"
        "$docker" rmi "podium-build/$stage:$tag" >/dev/null
      fi
    done
  fi
  for id in "${replaced[@]}"; do
    # Untagged now (an unchanged rebuild gives the same id, and it keeps its tag). A stopped
    # container still using it keeps it: said, not fatal.
    if [ "$("$docker" image inspect -f '{{len .RepoTags}}' "$id" 2>/dev/null)" = 0 ]; then
      "$docker" rmi "$id" >/dev/null 2>&1 || say "kept the replaced image $id (a container uses it)"
    fi
  done
  if [ "${PODIUM_PRUNE_DANGLING:-0}" = 1 ]; then
    "$docker" image prune -f >/dev/null
  fi
  after="$("$docker" images -q -f dangling=true | wc -l)"
  say "dangling images: $before after the builds, $after now"
}
py_base=""
for target in "${targets[@]}"; do
  case "$target" in
    control-plane | pod)
      if [ -z "$py_base" ]; then
        py_base="$(python_base)"
        [ "$offline" != 1 ] || fill_wheelhouse "$py_base"
      fi
      build "podium-$target:$tag" --target "$target" --build-arg "BASE_IMAGE=$py_base" \
        --build-arg "PIP_OFFLINE=$offline" --build-arg "TORCH_VERSION=$torch_version" \
        --build-arg "TORCH_VARIANT=$torch_variant" .
      ;;
    redis | prometheus)
      deb_base="$(debian_base)"
      build "podium-$target:$tag" --build-arg "BASE_IMAGE=$deb_base" \
        -f "deploy/images/$target.Dockerfile" deploy/images
      ;;
    *) say "unknown target $target (control-plane, pod, redis, prometheus)"; exit 2 ;;
  esac
done
tidy
