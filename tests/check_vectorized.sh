#!/usr/bin/env bash
# Fails when a hot CPU-backend loop stops vectorizing.
#
# Loops are named by a marker comment on the line just above the loop (or
# above its #pragma lines):   /* FL_VECTORIZE: xent_softmax_grad */
# Each file holding markers is compiled the way the build compiles it (flags
# from <build>/compile_commands.json, so per-file options such as optim_kernels.c's
# -fno-math-errno count), at -O3, twice: -march=native and generic (no -march:
# SSE2 on x86-64). A marked loop passes when gcc's -fopt-info-vec report has
# "optimized: loop vectorized" on a line of that loop (its pragmas included)
# and no "couldn't vectorize loop" on its lines (a copy gcc made by unswitching
# or versioning that stayed scalar). EXPECTED lists every marker that must
# exist, so deleting a marker fails too.
#
# usage: [VERBOSE=1] tests/check_vectorized.sh [build-dir]     (default: build)
# Skips (exit 0, saying why) when the compiler is not gcc >= 9: the report
# format and what vectorizes are compiler-specific.
set -u
cd "$(dirname "$0")/.." || exit 2
BUILD=${1:-build}
CC_JSON="$BUILD/compile_commands.json"

EXPECTED="xent_max xent_exp_sum xent_softmax_grad
swiglu_fwd swiglu_bwd gelu_fwd gelu_bwd relu_fwd relu_bwd
rmsnorm_sumsq rmsnorm_out rmsnorm_bwd_dot rmsnorm_bwd_dx rmsnorm_dw
layernorm_sum layernorm_var layernorm_out_bias layernorm_out layernorm_bwd_dots layernorm_bwd_dx layernorm_dw_db
adamw adamw16 sgd scale add bias_fwd bias_bwd sumsq sumsq16 embedding_fwd embedding_bwd_wte embedding_bwd_wpe rope attn_fwd_max attn_fwd_exp attn_bwd_exp
attn_ex_fwd_exp attn_ex_bwd_exp"

if [ ! -f "$CC_JSON" ]; then
    echo "check_vectorized: FAIL: $CC_JSON not found (configure the build first: cmake -S . -B $BUILD)" >&2
    exit 2
fi

# The "command" entry of compile_commands.json for a source file (CMake writes
# one key per line; \" inside is the shell-quoted -DFL_GEMM_NAME="...").
compile_command() {
    awk -v f="$1" '
        /"command":/ { c = $0; sub(/^[^:]*: "/, "", c); sub(/",?[ \t]*$/, "", c); gsub(/\\"/, "\"", c); gsub(/\\\\/, "\\", c) }
        /"file":/ { g = $0; sub(/^[^:]*: "/, "", g); sub(/",?[ \t]*$/, "", g); if (g == f) { print c; exit } }
    ' "$CC_JSON"
}

files=$(grep -l 'FL_VECTORIZE:' src/backend/cpu/*.c src/backend/cpu/*.h 2>/dev/null)
[ -n "$files" ] || { echo "check_vectorized: FAIL: no FL_VECTORIZE markers found" >&2; exit 1; }

first=$(compile_command "$PWD/$(echo "$files" | head -n1)")
[ -n "$first" ] || { echo "check_vectorized: FAIL: no compile command for $(echo "$files" | head -n1) in $CC_JSON" >&2; exit 2; }
eval "set -- $first"
CC=$1
macros=$("$CC" -dM -E -x c /dev/null 2>/dev/null)
if echo "$macros" | grep -q '__clang__' || ! echo "$macros" | grep -q '__GNUC__'; then
    echo "check_vectorized: skipped: $CC is not gcc (the check reads gcc's -fopt-info-vec report)"
    exit 0
fi
gcc_major=$(echo "$macros" | awk '$2 == "__GNUC__" { print $3 }')
if [ "${gcc_major:-0}" -lt 9 ]; then
    echo "check_vectorized: skipped: gcc $gcc_major is older than 9 (different -fopt-info format)"
    exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
found=""

for src in $files; do
    cmd=$(compile_command "$PWD/$src")
    if [ -z "$cmd" ]; then
        echo "check_vectorized: FAIL: no compile command for $src in $CC_JSON" >&2
        fail=$((fail+1))
        continue
    fi
    eval "set -- $cmd"
    shift # the compiler
    args=()
    while [ $# -gt 0 ]; do
        case "$1" in
            -o | -c) shift ;;                          # output / input: set below
            -O* | -g* | -march=* | -mtune=* | -fsanitize* | -fno-sanitize*) ;; # the check's own optimization flags
            *) args+=("$1") ;;
        esac
        shift
    done
    base=$(basename "$src")
    # Marker ranges: name, first line (pragmas), the for line, last line.
    awk '
        function strip(s) { gsub(/\/\*.*\*\//, "", s); sub(/\/\/.*/, "", s); return s }
        { line[NR] = $0 }
        END {
            for (i = 1; i <= NR; i++) {
                if (line[i] !~ /FL_VECTORIZE:/) continue
                name = line[i]; sub(/.*FL_VECTORIZE:[ \t]*/, "", name); sub(/[ \t]*\*\/.*/, "", name)
                j = i + 1
                while (j <= NR && line[j] ~ /^[ \t]*#pragma/) j++
                if (line[j] !~ /^[ \t]*for[ \t]*\(/) { print "BAD", name, i, "marker is not followed by a for loop"; continue }
                f = j; depth = 0; opened = 0; last = 0
                for (k = f; k <= NR && !last; k++) {
                    s = strip(line[k])
                    if (k == f) sub(/^[ \t]*for[ \t]*\([^)]*\)/, "", s) # the header itself
                    n = split(s, ch, "")
                    for (c = 1; c <= n; c++) {
                        if (ch[c] == "{") { depth++; opened = 1 }
                        else if (ch[c] == "}") { depth--; if (opened && depth == 0) { last = k; break } }
                        else if (ch[c] == ";" && !opened) { last = k; break }
                    }
                }
                inner = 0
                for (k = f + 1; k <= last; k++) if (strip(line[k]) ~ /(^|[^a-z_])for[ \t]*\(/) inner = 1
                if (!last) print "BAD", name, i, "cannot find the end of the loop"
                else if (inner) print "BAD", name, i, "marked loop is not innermost"
                else print "LOOP", name, i + 1, f, last
            }
        }' "$src" > "$tmp/loops"
    for variant in native generic; do
        march=()
        [ "$variant" = native ] && march=(-march=native)
        report="$tmp/$base.$variant"
        if ! "$CC" "${args[@]}" -O3 "${march[@]}" -fopt-info-vec-all -c "$src" -o "$tmp/obj.o" > "$report" 2>&1; then
            echo "check_vectorized: FAIL: compiling $src ($variant) failed:" >&2
            head -n 20 "$report" >&2
            fail=$((fail+1))
            continue
        fi
        while read -r kind name a b c rest; do
            if [ "$kind" = BAD ]; then
                [ "$variant" = native ] && { echo "FAIL $name ($src:$a): $b $c $rest" >&2; fail=$((fail+1)); }
                continue
            fi
            [ "$variant" = native ] && found="$found $name"
            # a = first line (pragmas), b = for line, c = last line
            vec=$(awk -F: -v f="$base" -v a="$a" -v c="$c" '
                { p = $1; sub(/.*\//, "", p) }
                p == f && $2 >= a && $2 <= c && /optimized: loop vectorized/ { print $2; exit }' "$report")
            scalar=$(awk -F: -v f="$base" -v b="$b" -v c="$c" '
                { p = $1; sub(/.*\//, "", p) }
                p == f && $2 >= b && $2 <= c && /missed: couldn.t vectorize loop/ { n++ } END { print n + 0 }' "$report")
            if [ -n "$vec" ] && [ "$scalar" -eq 0 ]; then
                width=$(grep -E "(^|/)$base:$vec:[0-9]+: optimized: loop vectorized" "$report" | grep -o 'using [0-9]* byte' | sort -t' ' -k2 -n | tail -n1)
                [ -n "${VERBOSE:-}" ] && echo "ok   $name ($src:$b, $variant): vectorized ${width:+$width vectors}"
            else
                if [ -n "$vec" ]; then why="vectorized, but $scalar copy(ies) of it stayed scalar"; else why="NOT vectorized"; fi
                echo "FAIL $name ($src:$b, $variant, $("$CC" -dumpfullversion 2>/dev/null)): $why; gcc says:" >&2
                awk -F: -v f="$base" -v a="$a" -v c="$c" '
                    { p = $1; sub(/.*\//, "", p) }
                    p == f && $2 >= a && $2 <= c && /missed: / { print }' "$report" | sort -u | head -n 6 | sed 's/^/       /' >&2
                fail=$((fail+1))
            fi
        done < "$tmp/loops"
    done
done

for name in $EXPECTED; do
    case " $found " in
        *" $name "*) ;;
        *) echo "FAIL $name: its /* FL_VECTORIZE: $name */ marker is missing" >&2; fail=$((fail+1)) ;;
    esac
done

# counts for `make test`'s summary: one check per marked loop, one failure per report above
nloops=$(echo $EXPECTED | wc -w)
if [ "$fail" -ne 0 ]; then
    echo "check_vectorized: FAILED (a hot loop no longer vectorizes; see above)" >&2
    ok=$((nloops - fail)); [ "$ok" -lt 0 ] && ok=0
    echo "check_vectorized: $ok passed, $fail failed, 0 skipped"
    exit 1
fi
echo "check_vectorized: all $nloops marked loops vectorized (native and generic): $nloops passed, 0 failed, 0 skipped"
