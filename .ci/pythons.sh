# Sourced by .ci/run and .ci/pin: the interpreters of the two JAX lines we test.
#   python_311: a Python 3.11 (its newest JAX is 0.10.x: JAX 0.11 dropped 3.11)
#   python_new: the newest Python >= 3.12 here (the newest JAX), or nothing
# Each prints a path, or nothing when the machine has no such Python. pyenv's shims are on
# PATH even for versions that are not selected (and then fail), so every candidate is run.

_is_python() {  # _is_python CMD MIN MAX: CMD runs and MIN <= its minor version <= MAX
  "$1" -c "import sys; sys.exit(not (sys.version_info[0] == 3 and $2 <= sys.version_info[1] <= $3))" \
    >/dev/null 2>&1
}

_first_python() {  # _first_python MIN MAX CANDIDATE...
  local lo=$1 hi=$2 c
  shift 2
  for c in "$@"; do
    if _is_python "$c" "$lo" "$hi"; then
      "$c" -c "import sys; print(sys.executable)"
      return 0
    fi
  done
}

_pyenv_pythons() {  # pyenv's installed versions, newest first, whether selected or not
  local root=${PYENV_ROOT:-$HOME/.pyenv}
  ls -d "$root"/versions/3.* 2>/dev/null | sort -t. -k2,2nr -k3,3nr | sed 's|$|/bin/python3|'
}

python_311() {
  # shellcheck disable=SC2046
  _first_python 11 11 python3.11 python3 $(_pyenv_pythons)
}

python_new() {
  # shellcheck disable=SC2046
  _first_python 12 99 python3.14 python3.13 python3.12 $(_pyenv_pythons)
}
