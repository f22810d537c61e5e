#!/usr/bin/env bash
# check-fresh.sh: runs the README's two commands (`make demo`, `make test`) on
# new Debian 12 machines, as a newcomer would: a clean root built with
# debootstrap (Debian's packages only), a clean clone of this repository's
# HEAD copied in, then chroot. Three machines:
#   bare    the debootstrap root plus make
#   image   the project's image: gcc make cmake git python3 pkg-config
#   blas    the image plus libblas-dev (the reference BLAS, whose cblas.h is
#           the one Debian installs as /usr/include/<triplet>/cblas.h)
# It prints one line per machine and command with the time and PASS / FAIL;
# the logs stay in DIR/logs. Run it as root before resolving anything that
# changes dependencies or set-up.
#
#   scripts/check-fresh.sh [bare|image|blas ...]    default: all three
#
# Environment:
#   OPF_FRESH_DIR      work folder (default: $TMPDIR or /tmp, then opfuse-fresh);
#                      the debootstrapped base root is kept there, so reruns
#                      skip debootstrap (delete DIR/base to refresh it)
#   OPF_FRESH_MIRROR   Debian mirror for debootstrap (default deb.debian.org)
#   OPF_FRESH_COMMANDS the make targets to run (default "demo test")
#
# The host's network settings go in with each root: /etc/resolv.conf, apt's
# sources and settings, pip's configuration and the CA certificates.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${OPF_FRESH_DIR:-${TMPDIR:-/tmp}/opfuse-fresh}
mirror=${OPF_FRESH_MIRROR:-http://deb.debian.org/debian}
read -r -a commands <<<"${OPF_FRESH_COMMANDS:-demo test}"
suite=bookworm
variants=("$@")
[ ${#variants[@]} -gt 0 ] || variants=(bare image blas)

die() { echo "check-fresh: $*" >&2; exit 2; }
[ "$(id -u)" = 0 ] || die "needs root (debootstrap, chroot, mount)"
for tool in debootstrap chroot mount git; do
  command -v "$tool" >/dev/null 2>&1 || die "$tool not found (apt-get install debootstrap git)"
done

# The packages each machine starts with, on top of the debootstrap root.
packages() {
  case $1 in
    bare) echo make ;;
    image) echo gcc make cmake git python3 pkg-config ;;
    blas) echo gcc make cmake git python3 pkg-config libblas-dev ;;
    *) die "unknown machine \"$1\" (bare, image or blas)" ;;
  esac
}
for v in "${variants[@]}"; do packages "$v" >/dev/null; done

mkdir -p "$dir/logs"
mounts=()
unmount_all() {
  local i
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
    umount "${mounts[i]}" 2>/dev/null || umount -l "${mounts[i]}" || true
  done
  mounts=()
}
trap unmount_all EXIT INT TERM

# Removes a root, refusing while anything is still mounted under it.
remove_root() {
  [ -e "$1" ] || return 0
  if grep -q " $1/" /proc/self/mounts; then die "$1 still has mounts; not removing it"; fi
  rm -rf --one-file-system "$1"
}

# The pristine root, made once and copied for every machine.
base=$dir/base
if [ ! -x "$base/bin/bash" ]; then
  remove_root "$base.tmp"
  echo "check-fresh: debootstrap $suite into $base (once; log: $dir/logs/debootstrap.log)"
  debootstrap "$suite" "$base.tmp" "$mirror" >"$dir/logs/debootstrap.log" 2>&1 ||
    die "debootstrap failed; see $dir/logs/debootstrap.log"
  mv "$base.tmp" "$base"
fi

# Copies the host's network, apt and pip settings into root $1.
copy_host_config() {
  local r=$1 f
  cp -L /etc/resolv.conf "$r/etc/resolv.conf"
  [ -e /etc/hosts ] && cp -L /etc/hosts "$r/etc/hosts"
  if compgen -G '/etc/apt/sources.list.d/*' >/dev/null || [ -e /etc/apt/sources.list ]; then
    rm -f "$r/etc/apt/sources.list"
    [ -e /etc/apt/sources.list ] && cp /etc/apt/sources.list "$r/etc/apt/"
    cp -a /etc/apt/sources.list.d/. "$r/etc/apt/sources.list.d/" 2>/dev/null || true
  fi
  for f in apt.conf.d trusted.gpg.d keyrings; do
    [ -d "/etc/apt/$f" ] && mkdir -p "$r/etc/apt/$f" && cp -a "/etc/apt/$f/." "$r/etc/apt/$f/"
  done
  [ -e /etc/pip.conf ] && cp /etc/pip.conf "$r/etc/pip.conf"
  for f in .config/pip .pip; do
    [ -d "$HOME/$f" ] && mkdir -p "$r/root/$f" && cp -a "$HOME/$f/." "$r/root/$f/"
  done
  mkdir -p "$r/etc/ssl/certs" "$r/usr/local/share/ca-certificates"
  [ -e /etc/ssl/certs/ca-certificates.crt ] &&
    cp -L /etc/ssl/certs/ca-certificates.crt "$r/etc/ssl/certs/ca-certificates.crt"
  [ -d /usr/local/share/ca-certificates ] &&
    cp -a /usr/local/share/ca-certificates/. "$r/usr/local/share/ca-certificates/"
  return 0
}

mount_root() {
  local r=$1
  mount -t proc proc "$r/proc" && mounts+=("$r/proc")
  mount --bind /dev "$r/dev" && mounts+=("$r/dev")
  mount --bind /dev/pts "$r/dev/pts" && mounts+=("$r/dev/pts")
}

# Runs shell command $2 in root $1 as a login with a clean environment.
in_root() {
  chroot "$1" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    DEBIAN_FRONTEND=noninteractive /bin/bash -c "$2"
}

sha=$(git -C "$repo" rev-parse HEAD)
git -C "$repo" diff --quiet HEAD -- || echo "check-fresh: note: uncommitted changes are not tested (clone of $(git -C "$repo" rev-parse --short HEAD))"
echo "check-fresh: Debian 12 ($suite), commit $(git -C "$repo" rev-parse --short HEAD), logs in $dir/logs"
fails=0
for v in "${variants[@]}"; do
  root=$dir/root-$v
  remove_root "$root"
  cp -a "$base" "$root"
  copy_host_config "$root"
  git clone -q --no-checkout "$repo" "$root/root/opfuse"
  git -C "$root/root/opfuse" checkout -q "$sha"
  mount_root "$root"
  log=$dir/logs/$v-prepare.log
  if ! in_root "$root" "apt-get update && apt-get install -y $(packages "$v")" >"$log" 2>&1; then
    printf '%-6s %-10s %7s  FAIL (installing %s; log: %s)\n' "$v" "prepare" "-" "$(packages "$v")" "$log"
    fails=$((fails + 1))
    unmount_all
    continue
  fi
  for c in "${commands[@]}"; do
    log=$dir/logs/$v-$c.log
    t0=$(date +%s)
    if in_root "$root" "cd /root/opfuse && make $c" >"$log" 2>&1; then result=PASS
    else result=FAIL; fails=$((fails + 1)); fi
    printf '%-6s %-10s %6ss  %s\n' "$v" "make $c" "$(($(date +%s) - t0))" "$result"
  done
  unmount_all
done
exit $((fails > 0))
