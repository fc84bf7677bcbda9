#!/usr/bin/env bash
# Does a change train bit-identically? Runs fitllm_bitident from two builds (the same CPU, the
# same process environment) and diffs their fingerprints: every step's loss bits and the hash of
# the trained parameters, per case and backend (tests/bitident/bitident.c lists the cases).
#
#   tests/bitident/compare.sh OLD_BUILD NEW_BUILD [BACKEND...]     (default: cpu ref opaque, + cuda-emu if built)
#   FITLLM_BITIDENT_STEPS=N (default 20), FITLLM_BITIDENT_ONLY=SUBSTR (one case family)
#   FITLLM_BITIDENT_CACHE=1: keep OLD_BUILD's fingerprint in OLD_BUILD/bitident-*.txt and reuse it
#     (for a build that no longer changes; a build that changes must not be cached)
#
# OLD_BUILD is a build of the commit to compare against, with fitllm_bitident built in it (copy
# tests/bitident/ and the fitllm_bitident target into an older tree when it predates them).
# Exit 0: identical; 1: different (the first differing step of each case is shown); 2: cannot run.
set -u
old=${1:?usage: compare.sh OLD_BUILD NEW_BUILD [BACKEND...]}
new=${2:?usage: compare.sh OLD_BUILD NEW_BUILD [BACKEND...]}
shift 2
for b in "$old" "$new"; do
    [ -x "$b/fitllm_bitident" ] || { echo "compare.sh: $b/fitllm_bitident not built (cmake --build $b --target fitllm_bitident)"; exit 2; }
done
backends=("$@")
if [ ${#backends[@]} -eq 0 ]; then
    backends=(cpu ref opaque)
    "$new/fitllm_bitident" --steps 1 --only full-32true-accum1 cuda-emu >/dev/null 2>&1 && backends+=(cuda-emu)
fi
args=(--steps "${FITLLM_BITIDENT_STEPS:-20}")
[ -n "${FITLLM_BITIDENT_ONLY:-}" ] && args+=(--only "$FITLLM_BITIDENT_ONLY")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
key=$(echo "${args[*]} ${backends[*]}" | tr -c 'A-Za-z0-9\n-' '_')
cache="$old/bitident-$key.txt"
if [ "${FITLLM_BITIDENT_CACHE:-0}" = 1 ] && [ -s "$cache" ]; then
    cp "$cache" "$tmp/old"
else
    "$old/fitllm_bitident" "${args[@]}" "${backends[@]}" >"$tmp/old" 2>"$tmp/old.err"
    [ "${FITLLM_BITIDENT_CACHE:-0}" = 1 ] && cp "$tmp/old" "$cache"
fi
"$new/fitllm_bitident" "${args[@]}" "${backends[@]}" >"$tmp/new" 2>"$tmp/new.err"
# cases the older build does not have (added since) have no baseline: compared no further, listed
awk 'NR == FNR {have[$1" "$2] = 1; next} !(($1" "$2) in have) {print $2}' "$tmp/old" "$tmp/new" | sort -u >"$tmp/added"
if [ -s "$tmp/added" ]; then
    awk 'NR == FNR {add[$1] = 1; next} !($2 in add)' "$tmp/added" "$tmp/new" >"$tmp/new.common"
    mv "$tmp/new.common" "$tmp/new"
    echo "bitident: new cases without a baseline in $old (not compared): $(tr '\n' ' ' <"$tmp/added")"
fi
n=$(wc -l <"$tmp/new")
if cmp -s "$tmp/old" "$tmp/new"; then
    errs=$(grep -c ' ERROR ' "$tmp/new")
    echo "bitident: IDENTICAL: $n lines (${backends[*]}; $(cut -d' ' -f2 "$tmp/new" | sort -u | wc -l) cases; $errs cases refused alike)"
    exit 0
fi
echo "bitident: DIFFERENT (${backends[*]}): the first differing step of each case (< old, > new):"
diff "$tmp/old" "$tmp/new" | awk '/^[<>]/ {k=$1" "$2" "$3; if (!(k in seen)) {seen[k]=1; print "  " $0}}' | head -80
exit 1
