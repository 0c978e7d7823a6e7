# Sourced by the build and test scripts: copy_source REPO DEST copies the
# project's source files into DEST (made fresh), never its build products.
# In a git checkout: what git lists (tracked, and untracked but not
# ignored).  In a tree without .git (an unpacked sdist or release tarball):
# every file but builds, venvs, caches and compiled extensions.
copy_source() {
    local repo="$1" dest="$2"
    rm -rf "$dest"
    mkdir -p "$dest"
    if git -C "$repo" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
        git -C "$repo" ls-files -z --cached --others --exclude-standard \
            | (cd "$repo" && xargs -0 cp --parents -t "$dest")
    else
        (cd "$repo" && find . \( -name .git -o -name build -o -name wheelhouse -o -name dist \
                                 -o -name .venv -o -name __pycache__ -o -name '*.egg-info' \) -prune \
                              -o -type f ! -name '*.so' ! -name '*.pyd' -print0 \
            | xargs -0 cp --parents -t "$dest")
    fi
}
