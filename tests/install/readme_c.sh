#!/bin/sh
# readme_c.sh: the README's C examples ("## A C example" up to the next "## "),
# which continue one another, compiled as one program against the build tree
# and run; every call must succeed (opf_last_error empty at the end). Keeps
# the README's code from drifting from the API.
#     readme_c.sh SOURCE_DIR BUILD_DIR CC
set -eu
src=$1 build=$2 cc=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
awk '/^## A C example/ { on = 1; next } on && /^## / { exit }
     on && /^```c$/ { inblock = 1; next } inblock && /^```$/ { inblock = 0; next }
     inblock' "$src/README.md" >"$tmp/blocks.c"
test -s "$tmp/blocks.c" || { echo "no C blocks under '## A C example' in README.md"; exit 1; }
{
  grep '^#include' "$tmp/blocks.c"
  echo 'int main(void) {'
  grep -v '^#include' "$tmp/blocks.c"
  # what the examples leave open, and the check that no call failed
  echo 'const char *err = opf_last_error(ctx);'
  echo 'int bad = err && *err;'
  printf '%s\n' 'if (bad) fprintf(stderr, "README example: %s\n", err);'
  echo 'opf_tensor_release(&in), opf_tensor_release(&dy);'
  echo 'opf_optim_destroy(opt), opf_seq_destroy(seq), opf_ctx_destroy(ctx);'
  echo 'return bad; }'
} >"$tmp/readme.c"
"$cc" -std=c17 -Wall -Wextra -Werror -I"$src/include" "$tmp/readme.c" -o "$tmp/readme" \
  -L"$build" -lopfuse -lm -Wl,-rpath,"$build" || { cat -n "$tmp/readme.c"; exit 1; }
"$tmp/readme" >"$tmp/out.txt" || { tail -5 "$tmp/out.txt"; exit 1; }
grep -q "digraph" "$tmp/out.txt" || { echo "the compiled example printed no DOT graph"; exit 1; }
echo "README's C examples: compiled and ran ($(wc -l <"$tmp/blocks.c") lines)"
