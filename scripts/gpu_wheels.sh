#!/usr/bin/env bash
# Download the wheels the lent GPU machine lacks (scripts/gpu_wheels.txt: pinned, --no-deps), for that
# machine's interpreter (CPython 3.12, manylinux x86_64), so that scripts/gpu_check.sh --wheels DIR can
# install them there with no network. Run it here, where PyPI is reachable (docs/gpu.md).
#
#   scripts/gpu_wheels.sh DIR [--local-python PY LOCAL_DIR] [--max-mib N]
#
#   DIR                     the folder for the GPU machine's wheels (created; a wheel of another version of a
#                           listed package in it is an error: two versions stop the install there)
#   --local-python PY DIR2  also the same pinned versions for interpreter PY (e.g. this machine's, for the
#                           rehearsal, scripts/gpu_rehearse.sh); most are py3-none-any and equal to DIR's
#   --max-mib N             fail when DIR holds more than N MiB (default 40: the 64 MiB a call may carry,
#                           less the working tree)
# Prints each wheel and the total size. Exit 0 on success, 1 when a download fails or DIR is too big, 2 for
# bad usage.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PROG="gpu_wheels.sh"
LIST="$ROOT/scripts/gpu_wheels.txt"
die() { echo "$PROG: error: $*" >&2; exit 2; }

DIR="" LOCAL_PY="" LOCAL_DIR="" MAX_MIB=40
while [ $# -gt 0 ]; do
    case "$1" in
        --local-python) [ $# -ge 3 ] || die "--local-python needs an interpreter and a folder"
            LOCAL_PY="$2"; LOCAL_DIR="$3"; shift 3 ;;
        --max-mib) [ $# -ge 2 ] || die "--max-mib needs a number"; MAX_MIB="$2"; shift 2 ;;
        -h|--help) sed -n '2,/^set -u/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) [ -z "$DIR" ] || die "one DIR only (got '$DIR' and '$1')"; DIR="$1"; shift ;;
    esac
done
[ -n "$DIR" ] || die "missing DIR (the folder the wheels go to); see --help"
case "$MAX_MIB" in ''|*[!0-9]*) die "--max-mib must be a whole number, got '$MAX_MIB'" ;; esac
[ -f "$LIST" ] || die "no wheel list $LIST"

# the pinned list without comments
mapfile -t PINS < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$LIST" | grep -v '^$')
[ ${#PINS[@]} -gt 0 ] || die "$LIST names no wheel"
for p in "${PINS[@]}"; do
    case "$p" in *==*) ;; *) die "$LIST: '$p' is not pinned (name==version)" ;; esac
done

# a wheel's distribution name, normalised as PEP 503 does (Foo_Bar -> foo-bar)
norm() { echo "$1" | tr 'A-Z_.' 'a-z--'; }

check_versions() {  # DIR: one version per listed package, and that version the pinned one
    local dir="$1" p name ver f wname wver n bad=0
    for p in "${PINS[@]}"; do
        name="$(norm "${p%%==*}")" ver="${p#*==}" n=0
        for f in "$dir"/*.whl; do
            [ -e "$f" ] || continue
            wname="$(basename "$f" | cut -d- -f1)" wver="$(basename "$f" | cut -d- -f2)"
            [ "$(norm "$wname")" = "$name" ] || continue
            n=$((n + 1))
            if [ "$wver" != "$ver" ]; then
                echo "$PROG: error: $f is $name $wver, the list pins $ver (remove it)" >&2; bad=1
            fi
        done
        [ $n -gt 0 ] || { echo "$PROG: error: no wheel of $p in $dir" >&2; bad=1; }
    done
    return $bad
}

download() {  # PY DIR [pip platform flags...]
    local py="$1" dir="$2"; shift 2
    mkdir -p "$dir" || die "cannot create $dir"
    "$py" -m pip download -q --no-deps --only-binary=:all: "$@" -d "$dir" "${PINS[@]}" 2>&1 \
        | grep -v "is ignored: it is neither a file nor a directory" >&2
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { echo "$PROG: error: pip download into $dir failed (exit $rc)" >&2; return 1; }
    check_versions "$dir"
}

# the GPU machine: CPython 3.12 on manylinux x86_64 (the platforms its pip accepts)
download python3 "$DIR" --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any || exit 1
if [ -n "$LOCAL_PY" ]; then
    download "$LOCAL_PY" "$LOCAL_DIR" || exit 1
fi

bytes=0
for f in "$DIR"/*.whl; do
    s=$(stat -c %s "$f")
    bytes=$((bytes + s))
    printf '%10d  %s\n' "$s" "$(basename "$f")"
done
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "$PROG: ${#PINS[@]} pinned packages, $(ls "$DIR"/*.whl | wc -l) wheels, $bytes bytes ($mib MiB) in $DIR"
if [ "$bytes" -gt $((MAX_MIB * 1048576)) ]; then
    echo "$PROG: error: $DIR holds $mib MiB, over --max-mib $MAX_MIB" >&2
    exit 1
fi
exit 0
