#!/bin/sh
# example.sh: installs opfuse from a build tree into a temporary prefix, then
# builds examples/installed against it with pkg-config and with CMake and runs
# both programs.
#     example.sh BUILD_DIR EXAMPLE_DIR
set -eu
build=$1 example=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix

step() { echo "-- $*"; }
step "cmake --install into $prefix"
cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" || { cat "$tmp/install.log"; exit 1; }
# Only the shared library and the public headers go in.
find "$prefix" -name '*.a' | grep . && { echo "a static library was installed"; exit 1; }
test -e "$prefix/include/opfuse.h" && test -e "$prefix/include/opfuse/tensor.h"

step "pkg-config + make"
pcdir=$(dirname "$(find "$prefix" -name opfuse.pc)")
cp -r "$example" "$tmp/pc"
PKG_CONFIG_PATH=$pcdir make -s -C "$tmp/pc" example
"$tmp/pc/example"

step "CMake find_package(opfuse)"
cmake -S "$example" -B "$tmp/cmake" -DCMAKE_PREFIX_PATH="$prefix" >"$tmp/cmake.log" ||
  { cat "$tmp/cmake.log"; exit 1; }
cmake --build "$tmp/cmake" >>"$tmp/cmake.log" || { cat "$tmp/cmake.log"; exit 1; }
"$tmp/cmake/example"
