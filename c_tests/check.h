/* Shared by the C tests: CHECK counts checks and failures and prints the
 * library's last error on a failure; main() ends with CHECK_SUMMARY(). */
#ifndef PDXFER_C_TESTS_CHECK_H
#define PDXFER_C_TESTS_CHECK_H

#include "pdxfer.h"

#include <stdio.h>

static int failures = 0;
static int checks = 0;
#define CHECK(cond)                                                              \
    do {                                                                         \
        checks++;                                                                \
        if (!(cond)) {                                                           \
            failures++;                                                          \
            fprintf(stderr, "%s:%d: CHECK failed: %s (last error: %s)\n",        \
                    __FILE__, __LINE__, #cond, pdxfer_last_error());             \
        }                                                                        \
    } while (0)

/* Prints the plain closing line ("N passed, M failed") and gives the exit code. */
#define CHECK_SUMMARY() (printf("%d passed, %d failed\n", checks - failures, failures), failures ? 1 : 0)

#endif
