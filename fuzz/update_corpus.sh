#!/bin/sh
# Grow and re-minimize the regression corpus fuzz/corpus/<short>/ that `make test`'s replay reads (docs/FUZZING.md):
#   fuzz/update_corpus.sh SECONDS [NAME...]     (after fuzz/build.sh; default: every harness)
# Each harness runs SECONDS from its seeds and the current corpus (FUZZ_FRESH=1 fuzz/run.sh: an emptied working
# corpus build-fuzz/smoke/corpus-<short>/), then libFuzzer's -merge=1 keeps in fuzz/corpus/<short>/ the inputs that
# add coverage (the old ones first). Review the diff and commit it; a crash found on the way fails like run.sh.
set -e
cd "$(dirname "$0")/.."
secs=${1:-30}
[ $# -gt 0 ] && shift
names=${*:-$(cat build-fuzz/harnesses.txt)}
for name in $names; do
    short=${name#fuzz_}
    FUZZ_FRESH=1 fuzz/run.sh "$name" "$secs"
    mkdir -p "fuzz/corpus/$short" build-fuzz/merge
    rm -rf "build-fuzz/merge/$short" && mkdir -p "build-fuzz/merge/$short"
    # the merged set is written into a fresh folder (old corpus first, so its inputs are kept where they still count)
    build-fuzz/$name -merge=1 -max_len=1048576 "build-fuzz/merge/$short" "fuzz/corpus/$short" \
        "build-fuzz/smoke/corpus-$short" > "build-fuzz/logs/$name.merge.log" 2>&1
    rm -rf "fuzz/corpus/$short" && mv "build-fuzz/merge/$short" "fuzz/corpus/$short"
    echo "$name: fuzz/corpus/$short: $(ls "fuzz/corpus/$short" | wc -l) inputs, $(du -sk "fuzz/corpus/$short" | cut -f1) KB"
done
