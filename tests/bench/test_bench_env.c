/* test_bench_env.c: the benchmarks' shared helpers (bench/bench.h) that
 * decide how they time: OPF_BENCH_*_MS parsed strictly (a value that is not
 * a number of milliseconds >= 0 is said and the default used, never half
 * read), and the median. */
#define _POSIX_C_SOURCE 200809L
#include "bench.h"
#include "test.h"

static void test_env_ms(void)
{
    const char *name = "OPF_BENCH_TEST_MS";
    unsetenv(name);
    CHECK(opf_bench_env_ms(name, 300) == 300, "unset: the default");
    static const struct { const char *text; double want; } cases[] = {
        {"", 300},     {"0", 0},       {"250", 250},  {"2.5", 2.5},  {"1e3", 1000},
        {"-5", 300},   {"12x", 300},   {"ms", 300},   {"inf", 300},  {"nan", 300},
        {" 7", 7},     {"7 ", 7},      {" ", 300},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        setenv(name, cases[i].text, 1);
        double got = opf_bench_env_ms(name, 300);
        CHECK(got == cases[i].want, "%s=\"%s\": %g, want %g", name, cases[i].text, got,
              cases[i].want);
    }
    unsetenv(name);
}

static void test_median(void)
{
    double odd[] = {5, 1, 4, 2, 3};
    CHECK(opf_bench_median(odd, 5) == 3, "median of 1..5");
    double even[] = {4, 1, 3, 2};  /* element n / 2 after sorting: the upper middle */
    CHECK(opf_bench_median(even, 4) == 3, "median of 1..4");
    double one[] = {-2};
    CHECK(opf_bench_median(one, 1) == -2, "median of one");
}

int main(void)
{
    test_env_ms();
    test_median();
    TEST_DONE();
}
