#!/usr/bin/env bash
# Builds a plain (no CUDA) libfabric 2.x into the build tree, for `make test-lf2`:
#   build/lf2/prefix/lib/libfabric.so.1, build/lf2/prefix/bin/fi_info
#   build/lf2/.built-<version>   stamp: present = reuse, nothing is fetched or rebuilt
#
# Source: Debian 13 (trixie) source package libfabric (default 2.1.0-1.1), fetched with
# `apt-get source --download-only` through a private apt configuration under build/lf2/apt/
# (deb-src only; the system's sources.list and package lists are not touched, no trixie
# binary becomes installable). apt checks the files against the signed Sources index; the
# script checks the .orig tarball's sha256 against that index once more.
# Only the providers the tests use are built: tcp, sockets, shm, udp, ofi_rxm, ofi_rxd
# (+ sm2, ofi_hook_noop, off_coll, which 2.x always builds).
#
# Environment (all optional):
#   LF_DEB_VERSION  Debian source version  (default 2.1.0-1.1)
#   LF2_DIR         build root             (default <repo>/build/lf2)
#   JOBS            make -j                (default: nproc)
#   REBUILD=1       configure + make again even if the stamp is there
set -euo pipefail

LF_DEB_VERSION=${LF_DEB_VERSION:-2.1.0-1.1}
LF_UP_VERSION=${LF_DEB_VERSION%-*}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LF2_DIR=${LF2_DIR:-$REPO/build/lf2}
PREFIX=$LF2_DIR/prefix
SRC_DIR=$LF2_DIR/src
APT_DIR=$LF2_DIR/apt
OBJ_DIR=$LF2_DIR/obj
STAMP=$LF2_DIR/.built-$LF_DEB_VERSION
JOBS=${JOBS:-$(nproc)}
LOG=$LF2_DIR/build.log

say() { printf '==> lf2: %s\n' "$*"; }

if [[ ${REBUILD:-0} != 1 && -f $STAMP && -e $PREFIX/lib/libfabric.so.1 && -x $PREFIX/bin/fi_info ]]; then
  say "reusing $PREFIX ($(cat "$STAMP"))"
  exit 0
fi
mkdir -p "$LF2_DIR" "$SRC_DIR"
t_start=$(date +%s)

# ---------------------------------------------------------------- 0. build tools
need=()
# autoconf/automake/libtool: the .orig tarball is a git snapshot without configure.
for p in make gcc dpkg-dev xz-utils autoconf automake libtool; do dpkg -s "$p" >/dev/null 2>&1 || need+=("$p"); done
if ((${#need[@]})); then
  SUDO=""; [[ $(id -u) == 0 ]] || SUDO=sudo
  say "installing ${need[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# ---------------------------------------------------------------- 1. source
ORIG=$SRC_DIR/libfabric_${LF_UP_VERSION}.orig.tar.xz
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
[[ -f $KEYRING ]] || { echo "lf2: $KEYRING missing (package debian-archive-keyring)" >&2; exit 1; }
mkdir -p "$APT_DIR/lists/partial" "$APT_DIR/cache/archives/partial" "$APT_DIR/parts" "$APT_DIR/prefs"
cat >"$APT_DIR/sources.list" <<EOF
deb-src [signed-by=$KEYRING] http://deb.debian.org/debian trixie main
EOF
: >"$APT_DIR/status"
APT_OPTS=(
  -o Dir::Etc::SourceList="$APT_DIR/sources.list" -o Dir::Etc::SourceParts="$APT_DIR/parts"
  -o Dir::Etc::PreferencesParts="$APT_DIR/prefs"
  -o Dir::State::Lists="$APT_DIR/lists" -o Dir::State::status="$APT_DIR/status"
  -o Dir::Cache="$APT_DIR/cache" -o Debug::NoLocking=1 -o APT::Sandbox::User=root
)
srcrec() { apt-cache "${APT_OPTS[@]}" showsrc libfabric 2>/dev/null; }
if ! srcrec | grep -qx "Version: $LF_DEB_VERSION"; then
  say "apt-get update (private deb-src list: trixie main)"
  apt-get "${APT_OPTS[@]}" update -qq >"$LF2_DIR/apt-update.log" 2>&1 ||
    { cat "$LF2_DIR/apt-update.log"; exit 1; }
fi
want_sha=$(srcrec | awk -v v="$LF_DEB_VERSION" '
  /^Package:/ {ver=""} /^Version:/ {ver=$2}
  /^Checksums-Sha256:/ {f=1; next} /^[^ ]/ {f=0}
  f && ver == v && $3 ~ /\.orig\.tar\./ {print $1; exit}')
[[ -n $want_sha ]] || { echo "lf2: no source record for libfabric=$LF_DEB_VERSION in trixie" >&2; srcrec | grep '^Version:' >&2; exit 1; }
if [[ ! -f $ORIG ]] || [[ $(sha256sum "$ORIG" | cut -d' ' -f1) != "$want_sha" ]]; then
  say "apt-get source --download-only libfabric=$LF_DEB_VERSION"
  # Some mirrors serve only the .orig tarball (the .dsc/.debian.tar.xz 404): apt then exits
  # non-zero after fetching it, and the upstream tarball is used without Debian's patches.
  (cd "$SRC_DIR" && apt-get "${APT_OPTS[@]}" source -qq --download-only "libfabric=$LF_DEB_VERSION") >"$LF2_DIR/apt-source.log" 2>&1 ||
    { [[ -f $ORIG ]] || { cat "$LF2_DIR/apt-source.log"; exit 1; }
      echo "lf2: apt-get source fetched only the .orig tarball (see $LF2_DIR/apt-source.log)"; }
fi
got_sha=$(sha256sum "$ORIG" | cut -d' ' -f1)
[[ $got_sha == "$want_sha" ]] || { echo "lf2: sha256 mismatch for $ORIG: $got_sha != $want_sha" >&2; exit 1; }
TREE=$SRC_DIR/libfabric-$LF_UP_VERSION
DSC=$SRC_DIR/libfabric_${LF_DEB_VERSION}.dsc
rm -rf "$TREE"
if [[ -f $DSC && -f $SRC_DIR/libfabric_${LF_DEB_VERSION}.debian.tar.xz ]]; then
  # upstream + Debian's patches (dpkg-source checks the .dsc's checksums too)
  (cd "$SRC_DIR" && dpkg-source --no-check -x "$(basename "$DSC")" "$(basename "$TREE")" >/dev/null)
  note="Debian source package $LF_DEB_VERSION (upstream + Debian patches)"
else
  tar -xf "$ORIG" -C "$SRC_DIR"
  note="upstream tarball of Debian source package $LF_DEB_VERSION (Debian patches not applied)"
fi
t_src=$(date +%s)

# ---------------------------------------------------------------- 2. build
CONFIGURE_FLAGS=(
  --prefix="$PREFIX"
  --enable-only
  --enable-tcp=yes --enable-sockets=yes --enable-shm=yes
  --enable-udp=yes --enable-rxm=yes --enable-rxd=yes
  --disable-debug --disable-static --disable-silent-rules
  --without-cuda --without-rocr --without-ze --without-neuron --without-synapseai
  --without-uring --disable-lttng
)
rm -rf "$OBJ_DIR" "$PREFIX"; mkdir -p "$OBJ_DIR"
if [[ ! -x $TREE/configure ]]; then
  say "autogen.sh"
  (cd "$TREE" && ./autogen.sh) >"$LF2_DIR/autogen.log" 2>&1 || { tail -20 "$LF2_DIR/autogen.log"; exit 1; }
fi
t_gen=$(date +%s)
say "configure ($note)"
(cd "$OBJ_DIR" && "$TREE/configure" "${CONFIGURE_FLAGS[@]}") >"$LOG" 2>&1 || { tail -40 "$LOG"; exit 1; }
t_conf=$(date +%s)
say "make -j$JOBS"
(cd "$OBJ_DIR" && make -j"$JOBS" && make install) >>"$LOG" 2>&1 || { tail -40 "$LOG"; exit 1; }
t_end=$(date +%s)
"$PREFIX/bin/fi_info" --version | head -2
providers=$(LD_LIBRARY_PATH=$PREFIX/lib "$PREFIX/bin/fi_info" -l | grep -v version | tr -d ':' | xargs echo)
say "providers: $providers"
for p in tcp sockets shm; do
  LD_LIBRARY_PATH=$PREFIX/lib "$PREFIX/bin/fi_info" -p "$p" >/dev/null 2>&1 || { echo "lf2: fi_info -p $p finds nothing" >&2; exit 1; }
done
times="source $((t_src - t_start)) s, autogen $((t_gen - t_src)) s, configure $((t_conf - t_gen)) s, make+install $((t_end - t_conf)) s (-j$JOBS, $(nproc) cores)"
say "built in $((t_end - t_start)) s: $times"
printf 'libfabric %s from %s\nconfigure %s\nproviders: %s\nbuild: %s\n' "$LF_UP_VERSION" "$note" \
  "${CONFIGURE_FLAGS[*]}" "$providers" "$times" >"$STAMP"
