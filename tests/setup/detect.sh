#!/bin/sh
# detect.sh: scripts/setup.sh decides from what the build links. Runs it in
# check mode against fake roots (OPF_SETUP_ROOT) and checks what it asks for.
#     detect.sh path/to/setup.sh
set -u
setup=$1
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
failed=0

# expect NAME RC MODE WORDS...: setup MODE --check exits RC and prints every
# word; a word starting with ! must not appear.
expect() {
  name=$1 rc=$2 mode=$3
  shift 3
  out=$(OPF_SETUP_ROOT=$root bash "$setup" "$mode" --check 2>&1)
  got=$?
  ok=1
  [ "$got" = "$rc" ] || ok=0
  for w in "$@"; do
    case $w in
      !*) printf '%s\n' "$out" | grep -q -w -- "${w#!}" && ok=0 ;;
      *) printf '%s\n' "$out" | grep -q -F -- "$w" || ok=0 ;;
    esac
  done
  if [ $ok = 1 ]; then echo "ok   $name"; else
    echo "FAIL $name (exit $got, expected $rc; wanted: $*)"
    printf '%s\n' "$out" | sed 's/^/     | /'
    failed=1
  fi
}

# A machine with the tools, cJSON and the reference BLAS: libblas-dev's
# cblas.h, which Debian installs under the same path as OpenBLAS's.
lib=$root/usr/lib/x86_64-linux-gnu
mkdir -p "$root/usr/bin" "$root/usr/include/x86_64-linux-gnu" "$lib/pkgconfig" \
         "$root/usr/lib/python3.11/ensurepip" "$root/usr/include/python3.11"
for tool in make cmake cc pkg-config python3; do
  printf '#!/bin/sh\n' >"$root/usr/bin/$tool"
  chmod +x "$root/usr/bin/$tool"
done
touch "$root/usr/include/stdio.h" "$root/usr/include/x86_64-linux-gnu/cblas.h" \
      "$lib/libblas.so" "$lib/libcjson.so" "$root/usr/lib/python3.11/ensurepip/__init__.py" \
      "$root/usr/include/python3.11/Python.h"

expect "cblas.h without libopenblas asks for libopenblas-dev" 1 demo \
  libopenblas-dev "sudo apt-get install libopenblas-dev" "su -c 'apt-get install libopenblas-dev'" \
  '!libcjson-dev' '!cmake' '!gcc'

touch "$lib/libopenblas.so"
expect "libopenblas.so is enough" 0 demo "nothing missing" '!libopenblas-dev'
expect "make test on the same machine" 0 test "nothing missing"
rm "$lib/libopenblas.so"

if command -v pkg-config >/dev/null 2>&1; then
  printf 'Name: openblas\nDescription: x\nVersion: 0.3\nLibs: -lopenblas\n' >"$lib/pkgconfig/openblas.pc"
  expect "pkg-config openblas is enough" 0 demo "nothing missing"
  rm "$lib/pkgconfig/openblas.pc"
fi

touch "$lib/libopenblas.so"
rm "$root/usr/include/python3.11/Python.h"
expect "make test asks for Python.h (the extension)" 1 test python3-dev '!python3-venv'
expect "make demo needs no Python.h" 0 demo "nothing missing" '!python3-dev'
touch "$root/usr/include/python3.11/Python.h"
rm "$lib/libopenblas.so"
rm "$lib/libcjson.so" "$root/usr/lib/python3.11/ensurepip/__init__.py" "$root/usr/bin/python3"
rm "$root/usr/include/python3.11/Python.h"
expect "every missing package named at once" 1 test \
  "libopenblas-dev libcjson-dev python3 python3-venv python3-dev" '!pkg-config'
expect "make demo needs no Python" 1 demo "libopenblas-dev libcjson-dev" '!python3' '!python3-venv' '!python3-dev'

rm -rf "$root"/usr/bin/* "$root/usr/include/stdio.h"
expect "a bare root" 1 test "make cmake gcc libc6-dev libopenblas-dev libcjson-dev pkg-config python3 python3-venv python3-dev"

exit $failed
