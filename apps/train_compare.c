/* train_compare.c: `opfuse train --compare bf16,fp8-current,...`: the same
 * run under each recipe, one after the other; every evaluation goes to
 * PREFIX.csv (recipe, step, train loss, eval loss, exact match or -1), the
 * eval-loss curves to PREFIX.png through gnuplot when it is installed
 * (the script stays in PREFIX.gp), and a final table to stdout. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "train.h"

enum { MAX_RUNS = 16 };

typedef struct result {
    char   recipe[32];
    int    rc;
    double train_loss, eval_loss, accuracy, seconds, tokens_per_s;
} result;

/* One curve per recipe: eval loss against step, from the CSV. */
static void plot(const char *prefix, const result *r, int n)
{
    char path[1024], cmd[1200];
    snprintf(path, sizeof path, "%s.gp", prefix);
    FILE *f = fopen(path, "w");
    if (!f) return;
    fprintf(f, "set datafile separator ','\nset terminal pngcairo size 900,540\n"
               "set output '%s.png'\nset xlabel 'step'\nset ylabel 'eval loss'\nset logscale y\n"
               "set key top right\nset grid\nplot ", prefix);
    for (int i = 0; i < n; i++)
        fprintf(f, "%s'%s.csv' using (strcol(1) eq '%s' ? $2 : NaN):4 with linespoints title '%s'",
                i ? ", " : "", prefix, r[i].recipe, r[i].recipe);
    fprintf(f, "\n");
    fclose(f);
    if (system("command -v gnuplot >/dev/null 2>&1") != 0) {
        printf("plot: gnuplot is not installed (Debian: apt-get install gnuplot-nox); `gnuplot %s` "
               "then draws %s.png from %s.csv\n", path, prefix, prefix);
        return;
    }
    snprintf(cmd, sizeof cmd, "gnuplot '%s'", path);
    if (system(cmd) == 0) printf("plot: %s.png\n", prefix);
    else printf("plot: gnuplot failed on %s\n", path);
}

static void table(const result *r, int n, bool addition)
{
    printf("\n| recipe       | train loss | eval loss | exact match | tokens/s | seconds |\n"
           "|--------------|------------|-----------|-------------|----------|---------|\n");
    for (int i = 0; i < n; i++) {
        if (r[i].rc) {
            printf("| %-12s | failed     |           |             |          |         |\n", r[i].recipe);
            continue;
        }
        char acc[16] = "-";
        if (addition) snprintf(acc, sizeof acc, "%.1f%%", 100 * r[i].accuracy);
        printf("| %-12s | %10.4f | %9.4f | %11s | %8.0f | %7.1f |\n", r[i].recipe, r[i].train_loss,
               r[i].eval_loss, acc, r[i].tokens_per_s, r[i].seconds);
    }
}

int train_compare(const train_opts *base, int (*run)(trainer *t))
{
    const char *prefix = base->out ? base->out : "train_compare";
    char path[1024], list[512];
    snprintf(path, sizeof path, "%s.csv", prefix);
    snprintf(list, sizeof list, "%s", base->compare);
    FILE *csv = fopen(path, "w");
    if (!csv) {
        perror(path);
        return 1;
    }
    fprintf(csv, "recipe,step,train_loss,eval_loss,exact_match\n");
    result r[MAX_RUNS];
    int n = 0, rc = 0;
    for (char *save, *name = strtok_r(list, ",", &save); name && n < MAX_RUNS;
         name = strtok_r(NULL, ",", &save), n++) {
        trainer t;
        memset(&t, 0, sizeof t);
        t.o = *base;
        t.o.recipe = name;
        t.csv = csv;
        r[n].rc = run(&t);
        rc |= r[n].rc;
        snprintf(r[n].recipe, sizeof r[n].recipe, "%s", name);
        r[n].train_loss = t.last_loss, r[n].eval_loss = t.eval_loss, r[n].accuracy = t.accuracy;
        r[n].seconds = t.seconds, r[n].tokens_per_s = t.tokens_per_s;
        fflush(csv);
    }
    if (fclose(csv) != 0) {
        perror(path);
        return 1;
    }
    printf("\ncsv: %s\n", path);
    plot(prefix, r, n);
    table(r, n, !base->data);
    return rc;
}
