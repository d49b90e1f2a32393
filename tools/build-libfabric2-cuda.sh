#!/usr/bin/env bash
# Builds a CUDA-enabled libfabric 2.x (CUDA loaded with dlopen at run time, so no CUDA
# library is needed to build it or to load it) and packs it for a GPU host:
#   .gpu/libfabric2-cuda.tar.xz   lib/ (libfabric.so*), bin/fi_info, include/, cudart/
#   .gpu/libfabric2-cuda.txt      version, configure line, how to use it
#
# Runs on Debian 12 as root with Debian's apt archives and PyPI reachable. Idempotent:
# downloads and the build are reused when present (REBUILD=1 forces configure+make again).
#
# Sources:
#   libfabric  Debian 13 (trixie) source package, fetched with `apt-get source` through a
#              deb-src entry in /etc/apt/sources.list.d/ (no trixie binary is installed).
#   CUDA       headers only, from PyPI wheels: nvidia-cuda-runtime-cu12 (cuda.h,
#              cuda_runtime.h, libcudart.so.12), nvidia-nvml-dev-cu12 (nvml.h) and the crt/
#              headers of nvidia-cuda-nvcc-cu12 (cuda_runtime.h includes crt/host_config.h).
#
# Environment (all optional):
#   LF_DEB_VERSION  Debian source version       (default 2.1.0-1.1)
#   CUDA_WHEEL_VER  nvidia-cuda-runtime/nvml-dev (default 12.9.79)
#   NVCC_WHEEL_VER  nvidia-cuda-nvcc-cu12        (default 12.9.86)
#   WORK            scratch root                 (default /tmp)
#   PREFIX          install prefix               (default $WORK/lf2/prefix)
#   OUT_DIR         where the tarball goes       (default <repo>/.gpu)
#   JOBS            make -j                      (default 2)
#   REBUILD=1       rebuild even if $PREFIX has a libfabric
set -euo pipefail

LF_DEB_VERSION=${LF_DEB_VERSION:-2.1.0-1.1}
LF_UP_VERSION=${LF_DEB_VERSION%-*}
CUDA_WHEEL_VER=${CUDA_WHEEL_VER:-12.9.79}
NVCC_WHEEL_VER=${NVCC_WHEEL_VER:-12.9.86}
WORK=${WORK:-/tmp}
SRC_DIR=$WORK/lf-src
WHEEL_DIR=$WORK/cuda-wheels
CUDA_DIR=$WORK/cuda12                  # --with-cuda=<this>; headers in $CUDA_DIR/include
PREFIX=${PREFIX:-$WORK/lf2/prefix}
STAGE=$WORK/lf2/stage/libfabric2-cuda
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT_DIR=${OUT_DIR:-$REPO/.gpu}
JOBS=${JOBS:-2}
TARBALL=$OUT_DIR/libfabric2-cuda.tar.xz
NOTE=$OUT_DIR/libfabric2-cuda.txt

say() { printf '\n==> %s\n' "$*"; }
run() { printf '+ %s\n' "$*"; "$@"; }

CONFIGURE_FLAGS=(
  --prefix="$PREFIX"
  --enable-only
  --enable-tcp=yes --enable-shm=yes --enable-sockets=yes
  --enable-rxm=yes --enable-udp=yes --enable-rxd=yes
  --with-cuda="$CUDA_DIR" --enable-cuda-dlopen
  --disable-debug --disable-static
)

# ---------------------------------------------------------------- 0. build tools
say "0. build tools (bookworm packages)"
need=()
for p in autoconf automake libtool make gcc patchelf xz-utils python3 dpkg-dev; do
  dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
command -v pip >/dev/null 2>&1 || command -v pip3 >/dev/null 2>&1 || need+=(python3-pip)
if ((${#need[@]})); then
  run apt-get update
  run env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need[@]}"
else
  echo "all present"
fi
PIP=$(command -v pip || command -v pip3)

# ---------------------------------------------------------------- 1. libfabric source
say "1. libfabric $LF_DEB_VERSION source (Debian trixie source package)"
SRC_LIST=/etc/apt/sources.list.d/trixie-src.sources
if [[ ! -f $SRC_LIST ]]; then
  echo "writing $SRC_LIST (deb-src only: no trixie binaries become installable)"
  cat >"$SRC_LIST" <<'EOF'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: trixie bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  run apt-get update
elif ! apt-cache showsrc libfabric 2>/dev/null | grep -qx "Version: $LF_DEB_VERSION"; then
  run apt-get update
fi
apt-cache showsrc libfabric | grep '^Version:' | sed 's/^/  available: /'
mkdir -p "$SRC_DIR"
ORIG=$SRC_DIR/libfabric_${LF_UP_VERSION}.orig.tar.xz
TREE=$SRC_DIR/libfabric-$LF_UP_VERSION
# sha256 of the .orig tarball in the source record of exactly $LF_DEB_VERSION
want_sha=$(apt-cache showsrc libfabric | awk -v v="$LF_DEB_VERSION" '
  /^Package:/ {ver=""} /^Version:/ {ver=$2}
  /^Checksums-Sha256:/ {f=1; next} /^[^ ]/ {f=0}
  f && ver == v && $3 ~ /\.orig\.tar\./ {print $1; exit}')
[[ -n $want_sha ]] || { echo "no source record for libfabric=$LF_DEB_VERSION" >&2; exit 1; }
if [[ ! -f $ORIG ]] || [[ $(sha256sum "$ORIG" | cut -d' ' -f1) != "$want_sha" ]]; then
  # apt-get source unpacks (and applies Debian's patches) when the .dsc is reachable; some
  # mirrors serve only the .orig tarball, then apt exits non-zero and we unpack it ourselves.
  (cd "$SRC_DIR" && run apt-get source "libfabric=$LF_DEB_VERSION") ||
    echo "apt-get source did not finish (e.g. .dsc/.debian.tar.xz unavailable); using the .orig tarball"
fi
[[ -f $ORIG ]] || { echo "missing $ORIG" >&2; exit 1; }
got_sha=$(sha256sum "$ORIG" | cut -d' ' -f1)
[[ $got_sha == "$want_sha" ]] || { echo "sha256 mismatch for $ORIG: $got_sha != $want_sha" >&2; exit 1; }
echo "orig tarball sha256 OK ($got_sha, as in the trixie Sources index)"
if [[ ! -f $TREE/configure.ac ]]; then
  run tar -xf "$ORIG" -C "$SRC_DIR"
fi
if [[ -d $TREE/debian ]]; then
  DEB_NOTE="Debian source package $LF_DEB_VERSION (upstream + Debian patches)"
else
  DEB_NOTE="upstream tarball libfabric_${LF_UP_VERSION}.orig.tar.xz of Debian source package $LF_DEB_VERSION (sha256 $got_sha); Debian's patches not applied (.debian.tar.xz not fetched)"
fi

# ---------------------------------------------------------------- 2. CUDA headers
say "2. CUDA headers from PyPI wheels (headers only; CUDA is dlopen'ed at run time)"
mkdir -p "$WHEEL_DIR"
for spec in "nvidia-cuda-runtime-cu12==$CUDA_WHEEL_VER" "nvidia-nvml-dev-cu12==$CUDA_WHEEL_VER" \
            "nvidia-cuda-nvcc-cu12==$NVCC_WHEEL_VER"; do
  name=${spec%%==*}; ver=${spec##*==}
  if ls "$WHEEL_DIR/${name//-/_}-$ver-"*.whl >/dev/null 2>&1; then
    echo "have $spec"
  else
    run "$PIP" download --no-deps -d "$WHEEL_DIR" "$spec"
  fi
done
if [[ ! -f $CUDA_DIR/include/crt/host_config.h || ! -f $CUDA_DIR/include/nvml.h ]]; then
  rm -rf "$CUDA_DIR"; mkdir -p "$CUDA_DIR/include" "$CUDA_DIR/lib"
  WHEEL_DIR=$WHEEL_DIR CUDA_DIR=$CUDA_DIR python3 - <<'EOF'
import glob, os, shutil, zipfile
wd, cd = os.environ["WHEEL_DIR"], os.environ["CUDA_DIR"]
def pull(pattern, prefix, dest, only=None):
    whl = sorted(glob.glob(os.path.join(wd, pattern)))[-1]
    with zipfile.ZipFile(whl) as z:
        for n in z.namelist():
            if not n.startswith(prefix) or n.endswith("/"):
                continue
            rel = n[len(prefix):]
            if only and not only(rel):
                continue
            out = os.path.join(dest, rel)
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with z.open(n) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
    print("  from", os.path.basename(whl))
pull("nvidia_cuda_runtime_cu12-*.whl", "nvidia/cuda_runtime/include/", cd + "/include")
pull("nvidia_cuda_runtime_cu12-*.whl", "nvidia/cuda_runtime/lib/", cd + "/lib",
     only=lambda r: r == "libcudart.so.12")
pull("nvidia_nvml_dev_cu12-*.whl", "nvidia/nvml_dev/include/", cd + "/include")
pull("nvidia_cuda_nvcc_cu12-*.whl", "nvidia/cuda_nvcc/include/", cd + "/include",
     only=lambda r: r.startswith("crt/"))
EOF
fi
printf '#include <cuda.h>\n#include <cuda_runtime.h>\n#include <nvml.h>\nint main(void){return 0;}\n' >"$WORK/cuda-hdr-check.c"
run gcc -I"$CUDA_DIR/include" -c "$WORK/cuda-hdr-check.c" -o "$WORK/cuda-hdr-check.o"
echo "CUDA headers compile ($CUDA_DIR/include)"

# ---------------------------------------------------------------- 3. build
say "3. configure + build libfabric into $PREFIX"
if [[ ${REBUILD:-0} == 1 || ! -e $PREFIX/lib/libfabric.so.1 || ! -x $PREFIX/bin/fi_info ]]; then
  cd "$TREE"
  [[ -x configure ]] || run ./autogen.sh
  [[ ! -f Makefile ]] || run make distclean >/dev/null || true
  rm -rf "$PREFIX"
  echo "+ ./configure ${CONFIGURE_FLAGS[*]}"
  ./configure "${CONFIGURE_FLAGS[@]}" >"$WORK/lf-configure.log" 2>&1 ||
    { tail -30 "$WORK/lf-configure.log"; exit 1; }
  grep -E 'Built-in providers|DSO providers' "$WORK/lf-configure.log" || true
  grep -q '^#define HAVE_CUDA 1' config.h && grep -q '^#define ENABLE_CUDA_DLOPEN 1' config.h ||
    { echo "configure did not enable CUDA (dlopen)" >&2; exit 1; }
  grep -E '^#define (HAVE_CUDA|ENABLE_CUDA_DLOPEN|HAVE_CUDA_DMABUF) ' config.h
  run make -j"$JOBS" >"$WORK/lf-make.log" 2>&1 || { tail -40 "$WORK/lf-make.log"; exit 1; }
  run make install >"$WORK/lf-install.log" 2>&1 || { tail -20 "$WORK/lf-install.log"; exit 1; }
  cd - >/dev/null
else
  echo "reusing $PREFIX (REBUILD=1 to rebuild)"
fi
LIBREAL=$(basename "$(readlink -f "$PREFIX/lib/libfabric.so.1")")
echo "built: $PREFIX/lib/$LIBREAL, $("$PREFIX/bin/fi_info" --version | tr '\n' ' ')"

say "3b. checks"
export LD_LIBRARY_PATH=$PREFIX/lib
echo "+ fi_info -l"; "$PREFIX/bin/fi_info" -l | grep -v version | tr -d ':' | xargs echo "  providers:"
for p in tcp shm; do
  if "$PREFIX/bin/fi_info" -p "$p" -c FI_HMEM >/dev/null 2>&1; then r=reported; else r="not reported"; fi
  echo "  fi_info -p $p -c FI_HMEM: $r"
done
echo "  dlopen names compiled in: $(strings "$PREFIX/lib/$LIBREAL" | grep -E '^lib(cudart|cuda|nvidia-ml)\.so' | tr '\n' ' ')"
FI_LOG_LEVEL=info "$PREFIX/bin/fi_info" -p shm >/dev/null 2>"$WORK/lf-hmem.log" || true
grep -E 'cuda_hmem_dl_init|FI_HMEM_CUDA' "$WORK/lf-hmem.log" | sed 's/^/  /' | head -3
unset LD_LIBRARY_PATH

# ---------------------------------------------------------------- 4. pack
say "4. pack $TARBALL"
rm -rf "$STAGE"; mkdir -p "$STAGE/lib/pkgconfig" "$STAGE/bin" "$STAGE/include" "$STAGE/cudart"
cp -a "$PREFIX/lib/$LIBREAL" "$STAGE/lib/"
strip --strip-unneeded "$STAGE/lib/$LIBREAL"
ln -s "$LIBREAL" "$STAGE/lib/libfabric.so.1"
ln -s "$LIBREAL" "$STAGE/lib/libfabric.so"
sed -e 's|^prefix=.*|prefix=${pcfiledir}/../..|' "$PREFIX/lib/pkgconfig/libfabric.pc" >"$STAGE/lib/pkgconfig/libfabric.pc"
for b in fi_info fi_pingpong fi_strerror; do
  cp "$PREFIX/bin/$b" "$STAGE/bin/"
  strip "$STAGE/bin/$b"
  patchelf --set-rpath '$ORIGIN/../lib' "$STAGE/bin/$b"
done
cp -a "$PREFIX/include/rdma" "$STAGE/include/"
# optional: libfabric dlopens the unversioned name "libcudart.so"; a pip wheel or a driver
# install has only libcudart.so.12, so ship that file plus the unversioned link.
cp "$CUDA_DIR/lib/libcudart.so.12" "$STAGE/cudart/"
ln -s libcudart.so.12 "$STAGE/cudart/libcudart.so"

CONF_LINE="./configure ${CONFIGURE_FLAGS[*]}"
cat >"$STAGE/README.txt" <<EOF
libfabric $LF_UP_VERSION with CUDA (dlopen) support, built $(date -u +%Y-%m-%d) on $(. /etc/os-release; echo "$PRETTY_NAME") x86-64
by tools/build-libfabric2-cuda.sh of nixl-fabric.

Source: $DEB_NOTE
CUDA headers: PyPI nvidia-cuda-runtime-cu12==$CUDA_WHEEL_VER, nvidia-nvml-dev-cu12==$CUDA_WHEEL_VER,
  crt/ from nvidia-cuda-nvcc-cu12==$NVCC_WHEEL_VER (headers only; nothing CUDA is linked).
Configure: $CONF_LINE
Providers: tcp, shm, sockets, ofi_rxm, udp, ofi_rxd (+ sm2, ofi_hook_noop, off_coll, which are always built)
Library: lib/$LIBREAL (SONAME libfabric.so.1), NEEDED only libc; glibc >= 2.34.

Contents
  lib/libfabric.so*        the library
  lib/pkgconfig/           relocatable libfabric.pc (PKG_CONFIG_PATH=<dir>/lib/pkgconfig)
  include/rdma/            2.x headers (to build against 2.x)
  bin/fi_info, fi_pingpong, fi_strerror   (RUNPATH \$ORIGIN/../lib)
  cudart/libcudart.so.12   CUDA 12.9 runtime from the pip wheel, and libcudart.so -> it

Use
  tar -xJf libfabric2-cuda.tar.xz -C /opt        # -> /opt/libfabric2-cuda
  export LD_LIBRARY_PATH=/opt/libfabric2-cuda/lib:\$LD_LIBRARY_PATH
  /opt/libfabric2-cuda/bin/fi_info --version; fi_info -l; fi_info -p shm -c FI_HMEM

CUDA at run time
  libfabric dlopen()s "libcudart.so" (unversioned!), "libcuda.so.1" and "libnvidia-ml.so.1".
  libcuda.so.1 and libnvidia-ml.so.1 come with the NVIDIA driver. For libcudart.so either put a
  directory holding an unversioned libcudart.so link on LD_LIBRARY_PATH, or use the one here:
    export LD_LIBRARY_PATH=/opt/libfabric2-cuda/lib:/opt/libfabric2-cuda/cudart:\$LD_LIBRARY_PATH
  (cudart 12.9 runs on a CUDA 12.9+ driver, e.g. the CUDA 13 driver.) Without it libfabric logs
  "Failed to dlopen libcudart.so" (FI_LOG_LEVEL=info) and FI_HMEM_CUDA is not supported.
  Check: FI_LOG_LEVEL=info fi_info -p shm 2>&1 | grep -iE 'cuda|hmem'

FI_HMEM notes (libfabric $LF_UP_VERSION source)
  shm and ofi_rxm declare FI_HMEM; shm's FI_HMEM entry is listed even where CUDA is missing.
  tcp (xnet) never declares FI_HMEM, and ofi_rxm drops FI_HMEM over a core without it, so
  "fi_info -p tcp -c FI_HMEM" finds nothing even with CUDA present; sockets/udp/rxd neither.

Binaries built against 2.x headers need symbol version FABRIC_1.8 (fi_getinfo etc.) and do not
load on libfabric 1.17; binaries built against 1.17 run on this 2.x library.
EOF
mkdir -p "$OUT_DIR"
(cd "$(dirname "$STAGE")" && run env XZ_OPT=-9e tar --owner=0 --group=0 -cJf "$TARBALL" "$(basename "$STAGE")")
cp "$STAGE/README.txt" "$NOTE"
{
  echo
  echo "Tarball: $TARBALL ($(stat -c %s "$TARBALL") bytes, sha256 $(sha256sum "$TARBALL" | cut -d' ' -f1))"
  echo "Top directory in the tarball: libfabric2-cuda/"
} >>"$NOTE"
tar -tJvf "$TARBALL"
say "done: $TARBALL ($(du -h "$TARBALL" | cut -f1)), $NOTE"
