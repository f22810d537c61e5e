/* opfuse.c: the opfuse command (placeholder main until subcommands land). */
#include <stdio.h>
int main(void) { return 0; }
