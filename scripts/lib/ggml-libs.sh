# Sourced by the scripts that build against a llama.cpp (build-llama-backend.sh,
# test-llama-backend.sh): ggml_lib_dir LLAMA_CPP_DIR prints the directory
# holding the ggml libraries to link against: $GGML_LIB_DIR, else
# LLAMA_CPP_DIR/build/bin (a CMake build of that tree), else the lib/ of the
# llama_cpp package of ${PYTHON:-python3} (llama-cpp-python); fails, saying
# so, when none holds libggml-base.
ggml_lib_dir() {
    local dir pkg
    has_base() { compgen -G "$1/libggml-base.so*" >/dev/null; }
    if [[ -n ${GGML_LIB_DIR:-} ]]; then
        has_base "$GGML_LIB_DIR" && { echo "$GGML_LIB_DIR"; return 0; }
        echo "no libggml-base.so* in GGML_LIB_DIR=$GGML_LIB_DIR" >&2
        return 1
    fi
    dir="$1/build/bin"
    has_base "$dir" && { echo "$dir"; return 0; }
    pkg="$("${PYTHON:-python3}" -c 'import llama_cpp, os; print(os.path.dirname(llama_cpp.__file__))' \
           2>/dev/null)" || pkg=""
    if [[ -n $pkg ]] && has_base "$pkg/lib"; then
        echo "$pkg/lib"
        return 0
    fi
    echo "libggml-base not found: set GGML_LIB_DIR, build llama.cpp in $1/build," \
         "or install llama-cpp-python for ${PYTHON:-python3}" >&2
    return 1
}

# ggml_lib LIB_DIR NAME: the file of libNAME in LIB_DIR (libNAME.so, or a
# versioned one) to link against by path.
ggml_lib() {
    local f
    for f in "$1/lib$2.so" "$1"/lib"$2".so.*; do
        [[ -f $f ]] && { echo "$f"; return 0; }
    done
    echo "no lib$2.so* in $1" >&2
    return 1
}
