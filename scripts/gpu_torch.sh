#!/usr/bin/env bash
# Brings a newer torch (default 2.12.1, the CUDA 13 build), its triton and an NCCL it can load to a GPU machine that
# has torch 2.11 and cannot reach an index, in parts of under 64 MiB (what one device call carries). torchtitan
# 0.3.0's FSDP of an MoE block under expert parallelism needs torch >= 2.12 (docs/torchtitan_trainer.md).
#
#   here:            bash scripts/gpu_torch.sh stage          # .gpu/t01 .. .gpu/tNN (git-ignored), ~62 MB each
#   GPU machine:     bash scripts/gpu_torch.sh keep .gpu/tNN  # one call per part (carry [".gpu/tNN"]): kept in $STASH
#   GPU machine:     source scripts/gpu_torch.sh install      # joins, checks, installs into $TORCH_SITE, sets PYTHONPATH
#
# Besides torch and triton only NCCL (and torchdata, pure Python) travels; torch's other NVIDIA libraries are the
# machine's own (those of its torch 2.11 wheel), linked into $TORCH_SITE/nvidia, where torch's RPATH
# `$ORIGIN/../../nvidia/...` looks.
# torch 2.12.1 asks for NCCL 2.29.7, cuDNN 9.20 and cuBLAS 13.1; the machine has NCCL 2.28.9, cuDNN 9.19 and cuBLAS
# 13.1.0.3. Its libtorch_cuda.so needs the same cuDNN, cuBLAS and CUDA runtime functions as 2.11's, but eight NCCL
# functions more (ncclCommMemStats, ncclCommSuspend, ncclCommResume, ncclPutSignal, ncclSignal, ncclWaitSignal,
# ncclGetPeerDevicePointer, ncclGetLsaMultimemDevicePointer): with NCCL 2.28.9 the import fails ("undefined
# symbol: ncclCommResume", seen on 4 H200s, 2026-11-28). NCCL 2.29.7 is not on the index this was built with; 2.32.3
# is, and defines all 46 NCCL functions torch 2.12.1 calls (NCCL_VERSION picks another).
# `install` prints what the new torch then sees (version, CUDA, NCCL, cuDNN, triton).
TORCH_VERSION=${TORCH_VERSION:-2.12.1}
TRITON_VERSION=${TRITON_VERSION:-3.7.1}
NCCL_VERSION=${NCCL_VERSION:-2.32.3}
TORCHDATA_VERSION=${TORCHDATA_VERSION:-0.11.0}
STASH=${STASH:-/root/gpu-stash/torch}
TORCH_SITE=${TORCH_SITE:-/tmp/torch-site}
PART_BYTES=${PART_BYTES:-62000000}

_gpu_torch_stage() {
  set -euo pipefail
  local root work plat
  root=$(git rev-parse --show-toplevel)
  cd "$root"
  grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.gpu/' >> .git/info/exclude; }
  work=$(mktemp -d)
  plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
  # shellcheck disable=SC2086
  # torchdata: torchtitan's trainer imports it; the 2-GPU machine of 2026-11-29 lacked it (earlier ones had it)
  python3 -m pip download -q --no-deps $plat -d "$work" "torch==$TORCH_VERSION" "triton==$TRITON_VERSION" \
    "nvidia-nccl-cu13==$NCCL_VERSION" "torchdata==$TORCHDATA_VERSION"
  rm -rf .gpu/t[0-9]*
  (cd "$work" && ls -- *.whl > wheels.txt && sha256sum -- *.whl > wheels.sha256 && cat -- *.whl > bundle \
     && split -d -a 2 -b "$PART_BYTES" bundle part-)
  local n=0 p
  for p in "$work"/part-*; do
    n=$((n + 1))
    local dir; dir=.gpu/t$(printf %02d "$n")
    mkdir -p "$dir"
    mv "$p" "$dir/"
  done
  # the last part also carries the list, the sizes and the checksums
  cp "$work/wheels.sha256" "$dir/"
  (cd "$work" && for w in $(cat wheels.txt); do echo "$w $(stat -c %s "$w")"; done) > "$dir/wheels.sizes"
  echo "$n" > "$dir/parts"
  rm -rf "$work"
  du -sh .gpu/t[0-9]* | tr '\n' ' '; echo
  echo "staged torch $TORCH_VERSION + triton $TRITON_VERSION + NCCL $NCCL_VERSION + torchdata $TORCHDATA_VERSION in $n parts: on the GPU machine one call per part," \
       "carry [\".gpu/tNN\"], 'bash scripts/gpu_torch.sh keep .gpu/tNN'; then 'source scripts/gpu_torch.sh install'"
}

_gpu_torch_keep() {
  local dir=$1
  mkdir -p "$STASH" && cp "$dir"/* "$STASH"/ && echo "kept $(ls "$dir" | tr '\n' ' ')in $STASH"
}

_gpu_torch_install() {
  if [ ! -f "$TORCH_SITE/.ready" ]; then
    if [ ! -f "$STASH/parts" ]; then
      echo "gpu_torch.sh: $STASH/parts is missing: keep every part first (the last one carries the list)" >&2
      return 1
    fi
    local n have
    n=$(cat "$STASH/parts"); have=$(ls "$STASH"/part-* 2>/dev/null | wc -l)
    if [ "$have" != "$n" ]; then
      echo "gpu_torch.sh: $have of $n parts in $STASH (a fresh machine loses them): keep the missing ones" >&2
      return 1
    fi
    local tmp; tmp=$(mktemp -d)
    (
      set -e
      cd "$tmp"
      cat "$STASH"/part-* > bundle
      off=0
      while read -r name size; do
        tail -c +$((off + 1)) bundle | head -c "$size" > "$name"
        off=$((off + size))
      done < "$STASH/wheels.sizes"
      rm bundle
      sha256sum -c --quiet "$STASH/wheels.sha256"
      mkdir -p "$TORCH_SITE"
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$TORCH_SITE" ./*.whl
    ) || { echo "gpu_torch.sh: install failed" >&2; rm -rf "$tmp"; return 1; }
    rm -rf "$tmp"
    # torch's RPATH looks for its NVIDIA libraries in ../../nvidia from torch/lib: NCCL is the one installed
    # there with it, the others are linked from the machine's own
    local nv d
    nv=$(python3 -c "import nvidia, os; print([p for p in nvidia.__path__ if os.path.isdir(os.path.join(p, 'cudnn'))][0])")
    for d in "$nv"/*/; do
      d=${d%/}
      [ -e "$TORCH_SITE/nvidia/$(basename "$d")" ] || ln -s "$d" "$TORCH_SITE/nvidia/$(basename "$d")"
    done
    touch "$TORCH_SITE/.ready"
  fi
  export PYTHONPATH=$TORCH_SITE${PYTHONPATH:+:$PYTHONPATH}
  python3 - <<'PY'
import torch, triton
try:  # torch checks the cuDNN it finds against its own on first use: 9.19 (the machine's) fails 2.12.1's 9.20
    cudnn = torch.backends.cudnn.version()
except RuntimeError as e:
    cudnn = f"unusable ({str(e).split(':')[1].strip()}); what needs cuDNN fails, the rest runs"
print("gpu_torch.sh: torch", torch.__version__, "from", torch.__file__, "| CUDA", torch.version.cuda,
      "| NCCL", ".".join(map(str, torch.cuda.nccl.version())), "| cuDNN", cudnn,
      "| triton", triton.__version__, "| GPUs", torch.cuda.device_count())
PY
}

case "${1:-}" in
  stage) (_gpu_torch_stage) ;;
  keep) _gpu_torch_keep "${2:?usage: gpu_torch.sh keep .gpu/tNN}" ;;
  install) _gpu_torch_install ;;
  *) echo "usage: bash scripts/gpu_torch.sh stage | bash scripts/gpu_torch.sh keep .gpu/tNN | source scripts/gpu_torch.sh install" >&2
     return 2 2>/dev/null || exit 2 ;;
esac
