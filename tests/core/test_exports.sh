#!/bin/sh
# test_exports.sh LIB INCLUDE_DIR: the shared library exports exactly the
# functions its public headers declare with OPF_API (opfuse/export.h), so
# nothing internal leaks and no public declaration lacks a definition. The
# lock clang's OpenMP makes for a reduction (.gomp_critical_user_*) is no opf_ symbol.
set -eu
lib=$1 inc=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

nm -D --defined-only "$lib" | awk '{print $NF}' | sed 's/@.*//' |
    grep -vxE '_init|_fini|_edata|_end|__bss_start|\.gomp_critical_user_.*' | sort -u >"$tmp/exported"
cat "$inc"/opfuse/*.h | grep -oE 'OPF_API [^(]*\bopf_[a-z0-9_]+[[:space:]]*\(' |
    grep -oE 'opf_[a-z0-9_]+[[:space:]]*\($' | tr -d ' (' | sort -u >"$tmp/declared"

status=0
leaked=$(comm -23 "$tmp/exported" "$tmp/declared")
missing=$(comm -13 "$tmp/exported" "$tmp/declared")
if [ -n "$leaked" ]; then
    echo "exported but not declared OPF_API in $inc:"; echo "$leaked"; status=1
fi
if [ -n "$missing" ]; then
    echo "declared OPF_API but not exported by $lib:"; echo "$missing"; status=1
fi
echo "$(wc -l <"$tmp/exported") symbols exported, $(wc -l <"$tmp/declared") declared OPF_API"
exit $status
