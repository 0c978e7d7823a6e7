# Sourced by the scripts that compile the core outside cffi (test-c.sh,
# build-llama-backend.sh): isa_sources ARCH prints the kernel files
# csrc/isa_list.h lists for ARCH (x86_64, aarch64, anything else: the
# portable one only), one path a line, under $repo/csrc ($repo set by the
# caller); fails if a listed file is missing.
isa_sources() {
    local want line arch file
    case "$1" in
        x86_64) want=X86_64 ;;
        aarch64) want=AARCH64 ;;
        *) want=none ;;
    esac
    while IFS= read -r line; do
        [[ $line =~ ^SA_ISA\(([a-z0-9_]+),\ \"[^\"]+\",\ ([A-Z0-9_]+),\ \"([^\"]+)\"\)$ ]] || continue
        arch="${BASH_REMATCH[2]}" file="${BASH_REMATCH[3]}"
        [[ $arch == ANY || $arch == "$want" ]] || continue
        if [[ ! -f "$repo/csrc/$file" ]]; then
            echo "isa_sources: csrc/$file (csrc/isa_list.h) is missing" >&2
            return 1
        fi
        echo "$repo/csrc/$file"
    done <"$repo/csrc/isa_list.h"
}
