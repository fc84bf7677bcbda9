/* fitllm command-line entry point. */
#include <stdio.h>
#include <string.h>

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        printf("usage: fitllm <command> [options]\n");
        return argc < 2 ? 2 : 0;
    }
    fprintf(stderr, "fitllm: unknown command '%s'\n", argv[1]);
    return 2;
}
