/* apps.h: the subcommands of the opfuse command. */
#ifndef OPFUSE_APPS_H
#define OPFUSE_APPS_H
int opf_demo_quantize(int argc, char **argv);
int opf_demo_train(int argc, char **argv);
/* opfuse graph [--recipe R] [--dir DIR] [--inference] (graph.c) */
int opf_app_graph(int argc, char **argv);
#endif
